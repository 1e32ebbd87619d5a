"""The local disk tier against what others leave in its way: a process hung holding a download's lock, an
earlier version's folders in root, links at the names it makes, a budget or a disk too small for what it
keeps, a Remote made by hand; against a real S3 server on 127.0.0.1 (moto's server mode)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

import s3server
from test_disk_tier import refused_plainly, snapshot
from tiny import make_adapter

from mstar.engine.resources.lora import objects
from mstar.engine.resources.lora.disk_tier import HOME, DiskTier


@pytest.fixture(scope="module")
def server():
    yield from s3server.serving("5s")


@pytest.fixture(scope="module")
def remotes(server, tmp_path_factory):
    """Two adapters in the bucket, under a prefix of this module's (a store is kept per URL, and each module
    has a server of its own): (their Remotes, their local folders)."""
    root = tmp_path_factory.mktemp("hostile")
    folders = [make_adapter(root, name=n, seed=i + 1)[1] for i, n in enumerate(["one", "two"])]
    for f in folders:
        s3server.upload(f, f"hostile/{f.name}")
    return [objects.pin(f"s3://{s3server.BUCKET}/hostile/{f.name}/") for f in folders], folders
# a process that took a folder's download lock and hangs there (a download stalled, a process stopped): it
# holds <key>.lock exclusive beside a .part that does not grow, until told to go
HANGER = """
import fcntl, os, sys
home, key = sys.argv[1], sys.argv[2]
os.makedirs(os.path.join(home, f".{key}.part"), exist_ok=True)
fd = os.open(os.path.join(home, f"{key}.lock"), os.O_RDONLY | os.O_CREAT, 0o666)
fcntl.flock(fd, fcntl.LOCK_EX)
print("holding", flush=True)
sys.stdin.readline()
"""


def test_a_download_lock_held_by_a_hung_process_fails_the_adapter_naming_the_lock_file(remotes, tmp_path):
    import threading

    from managers import one_node

    from mstar.engine.resources.lora.disk_tier import _folder
    from mstar.engine.resources.lora.manager import LoraManager

    [one, _], _ = remotes
    DiskTier(tmp_path, 10**9)
    key = _folder(one)
    hung = subprocess.Popen([sys.executable, "-c", HANGER, str(tmp_path / HOME), key], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    m = one_node()
    m = LoraManager(m.stores, m.pools, disk_tier=DiskTier(tmp_path, 10**9, wait=0.5))
    outcome: list = []

    def register():
        try:
            outcome.append(m.register("x", one.url))
        except ValueError as e:
            outcome.append(e)

    try:
        assert hung.stdout.readline() == "holding\n", hung.stderr.read()
        waiter = threading.Thread(target=register, daemon=True)
        waiter.start()
        waiter.join(120)  # a guard against a hang, not a measure: the tier waits at most 0.5 s of no progress
        assert not waiter.is_alive(), "the registration waited on the hung process's lock with no deadline"
    finally:
        hung.kill()
        hung.wait()
    [why] = outcome
    assert isinstance(why, ValueError), why
    text = str(why)
    assert text.startswith(f"adapter 'x' ({one.url}") and str(tmp_path / HOME / f"{key}.lock") in text, text
    assert "0.5 s" in text, text
    v = m.register("x", one.url)  # the hung process gone, its lock with it: served
    assert v.path == one
    m.close()


def earlier_layout(root: Path, one, two) -> Path:
    """root as an earlier version left it: one's folder at root/<key>, and a half download of two's by an ended
    process (.<key>.<pid>.<tid>); the half download returned."""
    from mstar.engine.resources.lora.disk_tier import _folder

    with DiskTier(root.parent / "fetch", 10**9).local(one) as folder:
        shutil.copytree(folder, root / _folder(one))
    left = root / f".{_folder(two)}.123.456"
    left.mkdir()
    (left / "adapter_config.json").write_bytes(b"{}")
    (left / ".adapter_model.safetensors.123.part").write_bytes(b"half")
    return left


def test_an_earlier_layout_s_folders_in_a_root_of_their_own_are_taken_into_the_tier_within_its_budget(
        remotes, tmp_path):
    from mstar.engine.resources.lora.disk_tier import _folder

    [one, two], [one_files, _] = remotes
    root = tmp_path / "root"
    left = earlier_layout(root, one, two)
    tier = DiskTier(root, 10**9)
    assert one in tier and not (root / _folder(one)).exists() and not left.exists(), "taken in; the half one gone"
    assert os.listdir(root) == [HOME]
    with tier.local(one) as folder:
        assert tier.downloads == 0 and folder == root / HOME / _folder(one)
        assert (folder / "adapter_model.safetensors").read_bytes() == \
            (one_files / "adapter_model.safetensors").read_bytes()
    with DiskTier(root, max_bytes=0).local(two):
        pass
    assert one not in tier and os.listdir(root / HOME) == [], "within the budget as any other folder"


def test_an_earlier_layout_s_folders_in_a_root_others_share_are_left_as_they_are(remotes, tmp_path):
    [one, two], _ = remotes
    root = tmp_path / "root"
    earlier_layout(root, one, two)
    hexes = "0123456789abcdef" * 2  # others' things beside them: an adapter of theirs in a 32-hex folder, too
    for path, data in {f"{hexes}/adapter_config.json": b"{}", f"{hexes}/adapter_model.safetensors": b"theirs",
                       ".bashrc": b"alias ll='ls -l'"}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    before = snapshot(root)
    tier = DiskTier(root, max_bytes=0)
    with tier.local(two):
        pass
    assert snapshot(root) == before and one not in tier, \
        "in a root others share, an adapter in a 32-hex folder may be theirs: nothing of root is touched"


def test_an_earlier_layout_s_folder_for_a_pin_the_tier_holds_is_dropped(remotes, tmp_path):
    from mstar.engine.resources.lora.disk_tier import _folder

    [one, _], [one_files, _] = remotes
    tier = DiskTier(tmp_path, 10**9)
    with tier.local(one) as folder:
        shutil.copytree(folder, tmp_path / _folder(one))
    DiskTier(tmp_path, 10**9)
    assert not (tmp_path / _folder(one)).exists()
    assert sorted(os.listdir(tmp_path / HOME)) == [_folder(one), f"{_folder(one)}.lock"], "one copy, the tier's"
    with tier.local(one) as folder:
        assert (folder / "adapter_config.json").read_bytes() == (one_files / "adapter_config.json").read_bytes()


def test_a_link_at_a_folder_s_name_in_the_tier_is_never_read_and_gives_way_to_the_download(remotes, tmp_path):
    from mstar.engine.resources.lora.disk_tier import _folder

    [one, two], [one_files, two_files] = remotes
    DiskTier(tmp_path, 10**9)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(two_files, elsewhere)  # another adapter's files, linked where one's folder would be
    (tmp_path / HOME / _folder(one)).symlink_to(elsewhere, target_is_directory=True)
    (tmp_path / HOME / f".{_folder(two)}.part").symlink_to(elsewhere, target_is_directory=True)
    tier = DiskTier(tmp_path, 10**9)
    assert one not in tier and tier.nbytes == 0, "a link is no folder of the tier's"
    for remote, files in ((one, one_files), (two, two_files)):
        with tier.local(remote) as folder:
            assert not folder.is_symlink()
            assert all((folder / f).read_bytes() == (files / f).read_bytes() for f in objects.FILES)
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted(p.name for p in two_files.iterdir()), \
        "where the links pointed is left as it was"


def test_a_link_at_a_lock_s_name_makes_no_file_where_it_points(remotes, tmp_path):
    from managers import one_node

    from mstar.engine.resources.lora.disk_tier import _folder
    from mstar.engine.resources.lora.manager import LoraManager

    [one, _], _ = remotes
    DiskTier(tmp_path, 10**9)
    target = tmp_path / "outside" / "made-by-the-tier"
    target.parent.mkdir()
    (tmp_path / HOME / f"{_folder(one)}.lock").symlink_to(target)
    m = one_node()
    m = LoraManager(m.stores, m.pools, disk_tier=DiskTier(tmp_path, 10**9))
    with pytest.raises(ValueError) as e:
        m.register("x", one.url)
    assert refused_plainly(str(e.value), one.url, tmp_path / HOME), str(e.value)
    assert not target.exists(), "the tier opened no file through a link someone put in its folder"
    m.close()


def test_room_is_made_within_the_budget_before_a_download_not_after_it(server, remotes, tmp_path):
    [one, two], [_, two_files] = remotes
    tier = DiskTier(tmp_path, max_bytes=max(one.nbytes, two.nbytes))  # room for one of them
    with tier.local(one):
        pass
    held: list[int] = []  # the folders' bytes in place as two's download starts
    server.mode, server.match, server.method, server.seconds = "slow", "hostile/two/", "GET", 0.0
    server.hook = lambda: held.append(tier.nbytes)
    try:
        with tier.local(two) as folder:
            assert (folder / "adapter_model.safetensors").read_bytes() == \
                (two_files / "adapter_model.safetensors").read_bytes()
    finally:
        server.mode = server.method = server.hook = None
    assert held and all(n + two.nbytes <= tier.max_bytes for n in held), \
        f"{held} bytes of other folders kept beside a download of {two.nbytes} within {tier.max_bytes}"
    assert one not in tier and two in tier


@pytest.fixture
def small_disk(tmp_path):
    """A file system of 88 KiB mounted at tmp_path/small (room for one of the test adapters, not two): a tmpfs,
    where the tests may mount one; skipped elsewhere."""
    where = tmp_path / "small"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=88k", "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("no tmpfs can be mounted here")
    yield where
    subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_gives_the_least_recent_folders_up_for_a_download_before_it_refuses(remotes, small_disk):
    [one, two], [_, two_files] = remotes
    assert one.nbytes + two.nbytes > 88 * 1024 > two.nbytes + 4096
    tier = DiskTier(small_disk, 10**9)  # a budget the disk cannot hold
    with tier.local(one):
        pass
    with tier.local(two) as folder:
        assert (folder / "adapter_model.safetensors").read_bytes() == \
            (two_files / "adapter_model.safetensors").read_bytes()
    assert one not in tier and two in tier
    full = r"could not be written to the disk tier \(No space left on device\)"
    with tier.local(one), pytest.raises(ValueError, match=full), tier.local(two):  # one (back) in use: refused
        pass
    assert not any(p.name.startswith(".") for p in (small_disk / HOME).iterdir()), "no partial file left"


@pytest.mark.parametrize("objects_", [(("../../escaped.json", "", 4),), (("adapter_config.json", "", -1),),
                                      (("adapter_config.json", "", 4), ("adapter_config.json", "", 4)),
                                      (("adapter_config.json", "", 4),),
                                      ((".", "", 4), ("adapter_config.json", "", 4))])
def test_a_remote_made_by_hand_names_only_the_adapter_s_two_files(remotes, tmp_path, objects_):
    [one, _], _ = remotes
    with pytest.raises(ValueError, match=r"^a Remote's objects are "):
        objects.Remote(one.url, objects_)
