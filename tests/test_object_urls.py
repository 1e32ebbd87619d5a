"""Object-store URLs as sources, against a real S3 server on 127.0.0.1 (moto's server mode) and a plain HTTP
file server: only the adapter's two files are pinned and fetched, a URL names its prefix and nothing outside
it however it is encoded, and a secret written into a URL shows in no refusal or listing."""

from __future__ import annotations

import functools
import shutil
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

import s3server
from managers import one_node
from tiny import make_adapter

from mstar.engine.resources.lora import objects
from mstar.engine.resources.lora.check import check_adapter_file
from mstar.engine.resources.lora.disk_tier import DiskTier
from mstar.engine.resources.lora.manager import LoraManager
from mstar.engine.resources.lora.resolvers import ObjectStoreResolver

BUCKET = f"s3://{s3server.BUCKET}"


@pytest.fixture(scope="module")
def server():
    yield from s3server.serving("3s")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return make_adapter(tmp_path_factory.mktemp("urls"), name="sql", seed=3)[1]


def manager(tmp_path) -> LoraManager:
    m = one_node()
    return LoraManager(m.stores, m.pools, disk_tier=DiskTier(tmp_path / "disk", 10**9))


def test_only_the_two_files_a_folder_is_read_from_are_pinned_and_fetched(server, adapter, tmp_path):
    s3server.upload(adapter, "urls/extra")
    import boto3

    for junk in ("optimizer.safetensors", "checkpoint-100.safetensors", "notes.txt"):
        boto3.client("s3").put_object(Bucket=s3server.BUCKET, Key=f"urls/extra/{junk}", Body=b"\0" * 4096)
    remote = objects.pin(f"{BUCKET}/urls/extra/")
    assert [n for n, _, _ in remote.objects] == ["adapter_config.json", "adapter_model.safetensors"]
    tier, gets = DiskTier(tmp_path / "disk", 10**9), server.gets
    with tier.local(remote) as folder:
        assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert server.gets - gets == 2, "one GET a file, none for what lies beside them"


@pytest.mark.parametrize("path", ["x/%2e%2e/ok", "x/%2E%2e/ok", "x/../ok", "./ok", "x/.%2e/ok", "%2e/ok",
                                  "x%2f..%2fok", "x%2F%2E%2E%2Fok", "x%5c..%5cok", "x\\..\\ok", "x/\t../ok",
                                  "x/.\n./ok", "x//ok", "x/\u2028/ok", "x/%E2%80%AE/ok", "x/%252e%252e/ok",
                                  "x/%zz/ok", "x/%c3/ok", "x/%c0%ae%c0%ae/ok", "x/%00/ok", "ok/?versionId=1",
                                  "ok/#frag", "ok?", "ok#"])
def test_a_url_that_would_name_something_else_once_parsed_is_refused(server, adapter, tmp_path, path):
    s3server.upload(adapter, "urls/ok")  # where the traversals would land
    m = manager(tmp_path)
    with pytest.raises(ValueError, match=r"(?s)^adapter 'x' \(.*\): its (URL|path|bucket|host) (has|is) "):
        m.register("x", f"{BUCKET}/urls/{path}/")
    assert "x" not in m.registry
    with pytest.raises(ValueError, match=r"^object-store prefix "):
        ObjectStoreResolver(f"{BUCKET}/urls/{path}/")
    m.close()


@pytest.mark.parametrize("url", [f"{BUCKET}/urls/ünï/", f"{BUCKET}/urls/a%20b/", f"{BUCKET}/urls/%C3%BCber/",
                                 f"{BUCKET}/urls/v1.0/", f"{BUCKET}/urls/x...y/"])
def test_a_url_whose_segments_are_names_is_served(server, adapter, tmp_path, url):
    from urllib.parse import unquote

    s3server.upload(adapter, unquote(url.removeprefix(f"{BUCKET}/")).rstrip("/"))
    m = manager(tmp_path)
    v = m.register("u", url)
    assert v.digest == check_adapter_file(m.stores["language_model"].spec, "u", adapter)
    assert [r.source for r in m.adapters().adapters] == [url]
    m.close()


def test_a_resolver_finds_no_adapter_where_there_is_no_config(server, adapter):
    s3server.upload(adapter, "urls/found")
    import boto3

    boto3.client("s3").put_object(Bucket=s3server.BUCKET, Key="urls/stray/adapter_model.safetensors", Body=b"0")
    resolver = ObjectStoreResolver(f"{BUCKET}/urls/")
    assert resolver("found") == f"{BUCKET}/urls/found/"
    assert resolver("stray") is None and resolver("nothing") is None, "objects, but no adapter's config"


@pytest.fixture(scope="module")
def web(tmp_path_factory, adapter):
    """A plain HTTP file server (no listing, no WebDAV) serving one adapter folder."""
    root = tmp_path_factory.mktemp("www")
    shutil.copytree(adapter, root / "adapters" / "sql")
    (root / "adapters" / "sql" / "optimizer.safetensors").write_bytes(b"\0" * 4096)
    quiet = type("Quiet", (SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(quiet, directory=str(root)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_an_adapter_on_a_plain_http_server_is_pinned_by_head_and_served(server, web, adapter, tmp_path):
    m = manager(tmp_path)  # server: AWS_ALLOW_HTTP, which lets obstore speak plain http
    v = m.register("web", f"{web}/adapters/sql/")
    assert v.digest == check_adapter_file(m.stores["language_model"].spec, "web", adapter)
    assert [n for n, _, _ in v.path.objects] == ["adapter_config.json", "adapter_model.safetensors"]
    with pytest.raises(ValueError, match=r"no adapter there: no adapter_config.json under it"):
        m.register("none", f"{web}/adapters/none/")
    m.close()


def test_a_file_replaced_on_a_plain_http_server_which_gives_no_etag_is_a_new_version(server, adapter, tmp_path):
    import os

    root = tmp_path / "www"
    shutil.copytree(adapter, root / "swap")
    quiet = type("Quiet", (SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(quiet, directory=str(root)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/swap/"
        remote = objects.pin(url)
        weights = root / "swap" / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[::-1])  # as long as before: only its time tells them apart
        os.utime(weights, (weights.stat().st_atime, weights.stat().st_mtime + 10))
        assert objects.pin(url) != remote, "a new pin: a new version"
        replaced = r"adapter_model\.safetensors was replaced in the store since it was"
        with pytest.raises(ValueError, match=replaced), DiskTier(tmp_path / "disk", 10**9).local(remote):
            pass
    finally:
        httpd.shutdown()


KEY, SECRET, SIGNATURE = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY", "c2lnbmF0dXJlZm9yZXZlcg"
WITH_SECRETS = [f"s3://{KEY}:{SECRET}@{s3server.BUCKET}/urls/ok/", f"S3://{KEY}:{SECRET}@{s3server.BUCKET}/urls/ok/",
                f"https://user:{SECRET}@127.0.0.1:9/urls/ok/", f"http://{SECRET}@127.0.0.1:9/urls/ok/",
                f"{BUCKET}/urls/ok/?X-Amz-Credential={KEY}&X-Amz-Signature={SIGNATURE}",
                f"https://127.0.0.1:9/urls/ok/?sig={SIGNATURE}@{SECRET}", f"s3://user:{SECRET}?x@{s3server.BUCKET}/ok/",
                f"s3://{KEY}:{SECRET[:9]}/{SECRET[9:]}@{s3server.BUCKET}/urls/ok/",
                f"s3://{KEY}%3A{SECRET}%40{s3server.BUCKET}/urls/ok/", f"ftp://{KEY}:{SECRET}@host/p/",
                f"{BUCKET}/urls/ok/#{SECRET}", f"abfs://{KEY.lower()}:{SECRET}@acct.dfs.core.windows.net/p/",
                f"s3:/{KEY}:{SECRET}@{s3server.BUCKET}/urls/ok/", f"s3:{KEY}:{SECRET}@{s3server.BUCKET}/urls/ok/",
                f"s3:///{KEY}:{SECRET}@{s3server.BUCKET}/urls/ok/", f"s3://{KEY}:{SECRET}@{s3server.BUCKET}/team@x/",
                f"s3://{KEY}:{SECRET[:9]}/{SECRET[9:]}@{s3server.BUCKET}/team@x/",
                f"https://127.0.0.1:9/{SECRET[9:]}@127.0.0.1:9/urls/ok/", f"gs://{KEY}@{s3server.BUCKET}/ok/"]


def secretless(text: str) -> bool:
    return not any(s in text for s in (KEY, KEY.lower(), SECRET, SECRET[:9], SECRET[9:], SIGNATURE))


@pytest.mark.parametrize("url", WITH_SECRETS)
def test_a_url_with_credentials_is_refused_and_its_secret_shown_nowhere(server, adapter, tmp_path, url):
    s3server.upload(adapter, "urls/ok")
    m = manager(tmp_path)
    with pytest.raises(ValueError, match=r"^adapter 'x' \(") as e:
        m.register("x", url)
    assert secretless(str(e.value)), str(e.value)
    if ("@" in url or "?" in url) and "://" in url and not url.startswith("ftp"):
        assert "credentials come from the client's standard chain (AWS_ACCESS_KEY_ID" in str(e.value)
    with pytest.raises(ValueError) as e:
        ObjectStoreResolver(url)
    assert str(e.value).startswith("object-store prefix ") and secretless(str(e.value)), str(e.value)
    with pytest.raises(ValueError) as e:
        objects.Remote(url, ())
    assert secretless(str(e.value)), str(e.value)
    assert secretless(repr(m.adapters())) and m.adapters().adapters == []
    m.close()


def test_a_resolver_giving_a_url_with_credentials_fails_its_requests_without_the_secret(server, adapter, tmp_path):
    from test_objects import until_settled

    from mstar.engine.resources.lora.manager import Request

    s3server.upload(adapter, "urls/ok")
    m = one_node()
    m = LoraManager(m.stores, m.pools, disk_tier=DiskTier(tmp_path / "disk", 10**9),
                    resolver=lambda name: WITH_SECRETS[int(name.removeprefix("n"))])
    _, failed, _ = until_settled(m, [Request(i, f"n{i}") for i in range(len(WITH_SECRETS))])
    assert sorted(failed) == list(range(len(WITH_SECRETS)))
    assert all(str(e).startswith(f"adapter 'n{i}' (") and secretless(str(e)) for i, e in failed.items()), failed
    assert secretless(repr(m.adapters())) and m.adapters().adapters == []
    m.close()


@pytest.mark.parametrize("key", ["team@x/sql", "a@b@c/sql", "@lead/sql"])
def test_an_at_sign_in_a_bucket_url_path_is_a_key_s_and_no_credential(server, adapter, tmp_path, key):
    from mstar.engine.resources.lora import urls

    s3server.upload(adapter, f"urls/{key}")
    url = f"{BUCKET}/urls/{key}/"
    m = manager(tmp_path)
    v = m.register("u", url)
    assert v.digest == check_adapter_file(m.stores["language_model"].spec, "u", adapter)
    assert [r.source for r in m.adapters().adapters] == [url] and urls.redacted(url) == url
    resolver = ObjectStoreResolver(url.removesuffix("sql/"))
    assert resolver("sql") == url and resolver("none") is None
    with pytest.raises(ValueError) as e:
        m.register("none", url.replace("/sql/", "/none/"))
    assert str(e.value).startswith(f"adapter 'none' ({url.replace('/sql/', '/none/')}):"), "shown as it is"
    m.close()


def test_an_abfs_container_at_its_account_is_no_credential():
    from mstar.engine.resources.lora import urls

    assert urls.checked("abfs://models@acct.dfs.core.windows.net/a") == "abfs://models@acct.dfs.core.windows.net/a/"
    assert urls.redacted(f"s3://{KEY}:{SECRET}@bucket/p/?X-Amz-Signature={SIGNATURE}") == "s3://***@bucket/p/"


@pytest.mark.parametrize("url", ["s3://../x/", "s3://./x/", "s3://-b/x/", "https://a b/x/", "s3://ü/x/", "https://[zz]/x/",
                                 "https://h:123456/x/", "s3:///x/", "s3:/bucket/x/", "s3:bucket/x/", "HTTPS:host/x",
                                 "s3://b/" + "a" * 2048 + "/"])
def test_a_source_near_a_url_is_checked_as_one_and_refused_unless_its_bucket_or_host_is_plain(url):
    from mstar.engine.resources.lora import urls

    assert objects.is_remote(url), "never looked up as a local path, whose refusal would echo it whole"
    with pytest.raises(ValueError, match=r"^its (URL|bucket|host) (is|has) "):
        urls.checked(url)
    assert len(urls.redacted(url)) <= urls.SHOWN + 3


def test_an_endpoint_with_credentials_shows_them_in_no_refusal(server, tmp_path, monkeypatch):
    m = manager(tmp_path)
    # the client's chain gives the endpoint (a store of its own: the bucket's name is this test's)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{KEY}:{SECRET}@127.0.0.1:{s3server.free_port()}")
    with pytest.raises(ValueError) as e:
        m.register("x", "s3://endpoint-with-credentials/p/")
    assert str(e.value).startswith("adapter 'x' (s3://endpoint-with-credentials/p/): adapter_config.json could not")
    assert secretless(str(e.value)) and "http://***@127.0.0.1:" in str(e.value), str(e.value)
    m.close()
