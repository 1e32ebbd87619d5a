"""Adapters in object storage, found on first use: a real S3 server on 127.0.0.1 (moto's server mode) behind a
proxy that injects faults on the wire; resolvers; the local disk tier; two ranks admitting alike."""

from __future__ import annotations

import shutil
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("obstore")
pytest.importorskip("moto")

import s3server
from managers import one_node
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import LoraAdapterStore, LoraDevicePool, specs_from_config
from mstar.engine.resources.lora.check import check_adapter_file
from mstar.engine.resources.lora.disk_tier import HOME, DiskTier
from mstar.engine.resources.lora.manager import LoraManager, Request
from mstar.engine.resources.lora.resolvers import FolderResolver, ObjectStoreResolver

PREFIX = f"s3://{s3server.BUCKET}/tenants/"


@pytest.fixture(scope="module")
def server():
    yield from s3server.serving("3s")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("objects")
    return {n: make_adapter(root, name=n, seed=i + 1)[1] for i, n in enumerate(["sql", "bot", "local", "other"])}


def manager(tmp_path, resolver=None, capacity=4, disk_bytes=10**9, **kw) -> LoraManager:
    m = one_node(capacity=capacity, slots=2)
    return LoraManager(m.stores, m.pools, resolver=resolver or ObjectStoreResolver(PREFIX),
                       disk_tier=DiskTier(tmp_path / "disk", disk_bytes), **kw)


def until_settled(m: LoraManager, waiting: list[Request], running=(), limit: int = 1500):
    """Steps until every waiting request is admitted or failed; (admitted, failed, steps taken)."""
    admitted, failed, queue, running = [], {}, list(waiting), list(running)
    for n in range(limit):
        step = m.step(running, queue)
        admitted += step.admitted
        running += [r for r in queue if r.id in step.admitted]
        failed.update(step.failed)
        queue = [r for r in queue if r.id not in step.admitted and r.id not in step.failed]
        if not queue:
            return admitted, failed, n + 1
        time.sleep(0.005)
    raise AssertionError(f"requests {[r.id for r in queue]} still waiting after {limit} steps")


def weights_in_slot(m: LoraManager, rid, step_slot: dict, path) -> bool:
    pool = m.pools["language_model"]
    ref = LoraAdapterStore(pool.spec, pin=False).read("ref", path)
    slot = step_slot[rid]
    return all(torch.equal(pool.a[t][slot], ref.a[t]) and torch.equal(pool.b[t][slot], ref.b[t]) for t in ref.a)


def test_an_adapter_in_a_bucket_is_resolved_on_its_first_request_and_served_as_its_file(server, adapters, tmp_path):
    s3server.upload(adapters["sql"], "tenants/sql")
    m = manager(tmp_path)
    m.register("local", adapters["local"])
    admitted, failed, steps = until_settled(m, [Request(1, "sql"), Request(2, "local")])
    assert failed == {} and admitted[0] == 2 and 1 in admitted and steps > 1, \
        "the local adapter was admitted at once; sql waited, off the step, while it was resolved and read"
    step = m.step([Request(1, "sql"), Request(2, "local")], [])
    spec = m.stores["language_model"].spec
    assert step.digest[1] == check_adapter_file(spec, "sql", adapters["sql"]), "its digest is its file's"
    assert weights_in_slot(m, 1, step.slot, adapters["sql"]), "its slot holds the file's weights"
    [row] = [r for r in m.adapters().adapters if r.name == "sql"]
    assert row.source == PREFIX + "sql/" and row.where == "slot"
    m.close()


def test_evicted_from_host_and_disk_it_is_fetched_again(server, adapters, tmp_path):
    s3server.upload(adapters["bot"], "tenants/bot")
    m = manager(tmp_path, capacity=1)
    until_settled(m, [Request(1, "bot")])
    m.register("local", adapters["local"])
    until_settled(m, [Request(2, "local")])  # bot's copy dropped from the host tier for local's
    remote = m.registry.resolve("bot").path
    assert m.stores["language_model"].get(m.registry.resolve("bot").key) is None
    assert m.disk_tier().evict(remote) and remote not in m.disk_tier()
    gets = server.gets
    admitted, _, _ = until_settled(m, [Request(3, "bot")])
    assert admitted == [3] and server.gets > gets and remote in m.disk_tier(), "downloaded again, then read"
    step = m.step([Request(3, "bot")], [])
    assert weights_in_slot(m, 3, step.slot, adapters["bot"])
    m.close()


@pytest.mark.parametrize("mode", ["500", "truncate", "down", "stall"])
def test_a_failing_bucket_fails_its_adapters_requests_only(server, adapters, tmp_path, mode):
    name = f"bad-{mode}"
    s3server.upload(adapters["other"], f"tenants/{name}")
    m = manager(tmp_path)
    m.register("local", adapters["local"])
    server.mode, server.match, server.method = mode, f"{name}/adapter_model", "GET"  # pinned; the download fails
    server.seconds = 30.0  # a stall: half the body, then nothing for ten times the store's timeout
    try:
        admitted, failed, _ = until_settled(m, [Request(1, name), Request(2, "local")], limit=10000)
    finally:
        server.mode = server.method = None
    assert admitted == [2] and list(failed) == [1], "the local adapter served; the bucket's failed"
    why = str(failed[1])
    assert why.startswith(f"adapter {name!r} (") and PREFIX + name in why and "adapter_model.safetensors" in why
    assert name not in m.registry and not any(p.name.startswith(".") for p in (tmp_path / "disk" / HOME).iterdir()), \
        "nothing of the failed download stays, not even a partial file"
    m.close()


def test_a_slow_bucket_blocks_no_step(server, adapters, tmp_path):
    s3server.upload(adapters["other"], "tenants/slow")
    m = manager(tmp_path)
    m.register("local", adapters["local"])
    server.mode, server.match, server.seconds = "slow", "slow/adapter_model", 1.5
    try:
        queue, served_meanwhile, steps = [Request(1, "slow")], 0, 0
        while queue:
            step = m.step([], [*queue, Request(100 + steps, "local")])
            served_meanwhile += (100 + steps) in step.admitted
            queue = [r for r in queue if r.id not in step.admitted and r.id not in step.failed]
            steps += 1
            time.sleep(0.01)
    finally:
        server.mode = None
    assert 1 not in step.failed and served_meanwhile >= 20, \
        f"while slow's download stalled, {served_meanwhile} steps admitted local's requests"
    m.close()


def test_an_object_replaced_in_the_bucket_is_a_new_version_never_served_under_the_old(server, adapters, tmp_path):
    s3server.upload(adapters["sql"], "tenants/swap")
    m = manager(tmp_path)
    until_settled(m, [Request(1, "swap")])
    old = m.registry.resolve("swap")
    s3server.upload(adapters["other"], "tenants/swap")  # replaced between the check and a later read
    for s in m.stores.values():
        s.drop(old.key)
    m.pools["language_model"].deactivate(old.key)
    m.disk_tier().evict(old.path)
    admitted, failed, _ = until_settled(m, [Request(2, "swap")])
    assert admitted == [] and "replaced in the store since it was checked" in str(failed[2])
    admitted, failed, _ = until_settled(m, [Request(3, "swap")])  # resolved anew: the new object
    step = m.step([Request(3, "swap")], [])
    spec = m.stores["language_model"].spec
    assert admitted == [3] and step.digest[3] == check_adapter_file(spec, "swap", adapters["other"]) != old.digest
    assert weights_in_slot(m, 3, step.slot, adapters["other"])
    m.close()


def test_an_unknown_name_fails_saying_where_it_was_looked_for_and_is_remembered_a_while(adapters, tmp_path):
    asked = []
    folders = FolderResolver(adapters["sql"].parent)

    def resolver(name):  # a user's own: the folder resolver, counted
        asked.append(name)
        return folders(name)

    m = manager(tmp_path, resolver=resolver, unknown_for=0.3)
    _, failed, _ = until_settled(m, [Request(1, "sqll")])
    assert str(failed[1]) == "adapter 'sqll' is not registered, and resolver resolver has no such adapter"
    _, failed, _ = until_settled(m, [Request(2, "sqll")])
    assert 2 in failed and asked == ["sqll"], "the answer is remembered: the source is not asked again"
    time.sleep(0.35)
    m.step([], [])  # the remembered answer let go, at a step
    until_settled(m, [Request(3, "sqll")])
    assert asked == ["sqll", "sqll"]
    m.prefetch([Request(4, "sql")])  # heard of while the forward runs: its resolution starts now
    m.wait_for_reads()
    assert asked[-1] == "sql"
    admitted, _, _ = until_settled(m, [Request(4, "sql")])
    assert admitted == [4], "a name the folder has is served"
    _, failed, _ = until_settled(m, [Request(6, "../sql")])
    assert "has no such adapter" in str(failed[6]), "a name that would step outside the folder is no adapter"
    m.close()


def test_a_name_whose_file_fails_its_check_fails_only_its_own_requests(adapters, tmp_path):
    root = tmp_path / "folders"
    shutil.copytree(adapters["sql"], root / "sql")
    shutil.copytree(adapters["bot"], root / "broken")
    (root / "broken" / "adapter_model.safetensors").write_bytes(b"\0" * 10)
    m = manager(tmp_path, resolver=FolderResolver(root))
    admitted, failed, _ = until_settled(m, [Request(1, "broken"), Request(2, "sql")])
    assert admitted == [2] and str(failed[1]).startswith("adapter 'broken' (")
    m.close()


def rank_main(rank: int, world_size: int, rendezvous: str, tmp: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    spec = specs_from_config(model_config("llama", num_attention_heads=4, num_key_value_heads=2), max_rank=8,
                             capacity=3)["language_model"]
    m = LoraManager({"language_model": LoraAdapterStore(spec, rank, world_size, pin=False)},
                    {"language_model": LoraDevicePool(spec, 2, rank=rank, world_size=world_size)},
                    group=dist.group.WORLD, resolver=ObjectStoreResolver(PREFIX),
                    disk_tier=DiskTier(f"{tmp}/disk{rank}", 10**9))
    log, queue = [], [Request(i, n) for i, n in enumerate(["tp-a", "tp-b", "tp-missing"])]
    for n in range(1500):
        if not queue:
            break
        step = m.step([], queue)
        log.append((n, sorted(step.admitted), sorted(step.failed)))
        queue = [r for r in queue if r.id not in step.admitted and r.id not in step.failed]
        time.sleep(0.002 * (rank + 1))  # the ranks' downloads and checks land at different moments
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, log)
    if rank == 0:
        torch.save(everyone, out)
    m.close()
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_admit_each_resolved_adapter_at_the_same_step(server, tmp_path):
    config = model_config("llama", num_attention_heads=4, num_key_value_heads=2)
    for i, n in enumerate(["tp-a", "tp-b"]):
        s3server.upload(make_adapter(tmp_path, name=n, seed=10 + i, config=config)[1], f"tenants/{n}")
    out = tmp_path / "log.pt"
    ctx = mp.start_processes(rank_main, args=(2, f"file://{tmp_path}/rdv", str(tmp_path), str(out)), nprocs=2,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=1):
        assert time.monotonic() < deadline, "a rank hung"
    a, b = torch.load(out)
    assert a == b, "both ranks admitted and failed the same requests at the same steps"
    assert sorted(r for _, adm, _ in a for r in adm) == [0, 1] and [r for _, _, f in a for r in f] == [2]


def test_the_disk_tier_downloads_once_for_concurrent_fetches_and_drops_the_least_recent_past_its_budget(
        server, adapters, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from mstar.engine.resources.lora import objects

    for n in ("t1", "t2", "t3"):
        s3server.upload(adapters["sql"], f"tenants/{n}")
    remotes = [objects.pin(f"{PREFIX}{n}/") for n in ("t1", "t2", "t3")]
    tier = DiskTier(tmp_path / "disk", max_bytes=2 * remotes[0].nbytes)  # room for two
    server.mode, server.match, server.seconds = "slow", "t1/adapter_model", 0.3  # the fetches overlap

    def fetch(_):
        with tier.local(remotes[0]) as folder:
            return (folder / "adapter_model.safetensors").read_bytes()

    try:
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(fetch, range(4)))
    finally:
        server.mode = None
    whole = (adapters["sql"] / "adapter_model.safetensors").read_bytes()
    assert tier.downloads == len(remotes[0].objects) and all(g == whole for g in got), \
        "four concurrent fetches, one download of each file, each read whole"
    for r in remotes[1:]:
        with tier.local(r):
            pass
    assert remotes[0] not in tier and remotes[1] in tier and remotes[2] in tier, "the least recent went"
    assert tier.nbytes <= tier.max_bytes


def test_a_download_longer_than_the_store_timeout_that_keeps_coming_is_served(server, adapters, tmp_path):
    s3server.upload(adapters["sql"], "tenants/long")
    m = manager(tmp_path)
    server.mode, server.match, server.method, server.seconds = "trickle", "long/adapter_model", "GET", 0.6
    try:  # eight pieces 0.6 s apart: 4.2 s in all, past the 3 s MSTAR_LORA_OBJECT_TIMEOUT, never 3 s without a byte
        v = m.register("long", PREFIX + "long/")
    finally:
        server.mode = server.method = None
    assert v.digest == check_adapter_file(m.stores["language_model"].spec, "long", adapters["sql"])
    m.close()


def test_an_object_replaced_between_its_pin_and_its_get_is_refused_where_the_store_ignores_if_match(
        server, adapters, tmp_path):
    from mstar.engine.resources.lora import objects

    s3server.upload(adapters["sql"], "tenants/ifm")
    remote = objects.pin(PREFIX + "ifm/")
    s3server.upload(adapters["other"], "tenants/ifm")  # replaced after the HEAD, before the GET
    assert objects.pin(PREFIX + "ifm/").objects != remote.objects
    assert [size for _, _, size in objects.pin(PREFIX + "ifm/").objects] == [size for _, _, size in remote.objects], \
        "as long as the old: only the ETag tells them apart"
    m = manager(tmp_path)
    server.mode, server.match, server.method = "no-if-match", "ifm/", "GET"  # a cache that drops If-Match
    try:
        with pytest.raises(ValueError) as e:
            m.register("ifm", remote)
    finally:
        server.mode = server.method = None
    assert str(e.value).startswith(f"adapter 'ifm' ({PREFIX}ifm/") and "replaced in the store" in str(e.value)
    assert remote not in m.disk_tier(), "the new object's bytes are kept under no folder of the old pin's"
    m.close()
