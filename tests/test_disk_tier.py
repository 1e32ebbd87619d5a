"""The local disk tier in a directory it shares: with its owner's other things, with another DiskTier of the
same process, and with other processes downloading and reading there, against a real S3 server on 127.0.0.1
(moto's server mode)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

import s3server
from tiny import make_adapter

from mstar.engine.resources.lora import objects
from mstar.engine.resources.lora.disk_tier import HOME, DiskTier

BUCKET = f"s3://{s3server.BUCKET}"

# a second process: its own DiskTier on root, fetching url; `hold` keeps the folder in use until told to go
CHILD = """
import sys
from pathlib import Path
from mstar.engine.resources.lora import objects
from mstar.engine.resources.lora.disk_tier import DiskTier
root, url, expected = sys.argv[1], sys.argv[2], Path(sys.argv[3])
with DiskTier(root, 10**9).local(objects.pin(url)) as folder:
    print("holding", flush=True)
    sys.stdin.readline()
    same = all((folder / f).read_bytes() == (expected / f).read_bytes()
               for f in ("adapter_config.json", "adapter_model.safetensors"))
print("read whole" if same else "read other bytes", flush=True)
"""


@pytest.fixture(scope="module")
def server():
    yield from s3server.serving("5s")


@pytest.fixture(scope="module")
def remotes(server, tmp_path_factory):
    """Two adapters in the bucket: (their Remotes, their local folders)."""
    root = tmp_path_factory.mktemp("tier")
    folders = [make_adapter(root, name=n, seed=i + 1)[1] for i, n in enumerate(["one", "two"])]
    for f in folders:
        s3server.upload(f, f"tier/{f.name}")
    return [objects.pin(f"{BUCKET}/tier/{f.name}/") for f in folders], folders


def child(root: Path, remote, folder: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(root), remote.url, str(folder)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root (outside the tier's own folder) and a file's bytes."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if Path(dirpath, d) != root / HOME]
        for d in dirs:
            out[os.path.relpath(Path(dirpath, d), root)] = None
        for f in files:
            out[os.path.relpath(Path(dirpath, f), root)] = Path(dirpath, f).read_bytes()
    return out


def test_the_tier_keeps_to_its_own_folder_in_a_directory_it_shares(remotes, tmp_path):
    [one, two], _ = remotes
    home = tmp_path / "home"  # a user's home, say, or a cache other tools share
    hexes = "0123456789abcdef" * 2
    for path, data in {".bashrc": b"alias ll='ls -l'", ".config/tool/settings": b"x=1", "projects/a.py": b"1",
                       f"{hexes}/weights.bin": b"mine", f".{hexes}.1.2/f": b"mine too", f"{HOME}/notes.txt": b"keep",
                       f"{HOME}/ff/f": b"keep", f"{HOME}/.hidden": b"keep", f"{HOME}/{hexes.upper()}/f": b"keep",
                       f"{HOME}/.{hexes}.part.old/f": b"keep"}.items():
        (home / path).parent.mkdir(parents=True, exist_ok=True)
        (home / path).write_bytes(data)
    before = snapshot(home)
    theirs = snapshot(home / HOME)
    tier = DiskTier(home, max_bytes=0)  # every folder of its own goes once it is not in use
    for r in (one, two):
        with tier.local(r) as folder:
            assert folder.parent == home / HOME
    assert one not in tier and two not in tier and tier.nbytes == 0
    assert snapshot(home) == before, "nothing outside its folder was touched"
    assert {p: b for p, b in snapshot(home / HOME).items() if p in theirs} == theirs, \
        "nothing in its folder that it did not name was touched"


def test_two_tiers_on_one_root_share_its_folders_and_neither_drops_one_the_other_reads(remotes, tmp_path):
    [one, two], [one_files, _] = remotes
    a, b = DiskTier(tmp_path, 10**9), DiskTier(tmp_path, max_bytes=0)
    with a.local(one) as folder:
        with b.local(one) as theirs:
            assert theirs == folder and b.downloads == 0, "b uses the folder a fetched"
        assert not b.evict(one), "a reads it"
        with b.local(two):
            pass  # b's trim, over its budget of 0: two goes, one (in a's use) stays
        assert two not in b and one in b
        assert (folder / "adapter_model.safetensors").read_bytes() == \
            (one_files / "adapter_model.safetensors").read_bytes()
    assert b.evict(one) and one not in a, "once a is done, b may drop it"
    downloads = a.downloads
    with a.local(one) as folder:  # a finds it gone, and fetches it again
        assert (folder / "adapter_config.json").read_bytes() == (one_files / "adapter_config.json").read_bytes()
    assert a.downloads == downloads + 2


def test_an_eviction_leaves_a_folder_another_process_reads(remotes, tmp_path):
    [one, two], [one_files, _] = remotes
    reader = child(tmp_path, one, one_files)
    try:
        assert reader.stdout.readline() == "holding\n", reader.stderr.read()
        tier = DiskTier(tmp_path, max_bytes=0)
        assert one in tier and not tier.evict(one), "in another process's use"
        with tier.local(two):
            pass  # its trim skips one
        assert one in tier and two not in tier
        reader.stdin.write("go\n")
        reader.stdin.flush()
        assert reader.stdout.readline() == "read whole\n", reader.stderr.read()
    finally:
        reader.kill()
        reader.wait()
    assert tier.evict(one), "the reader is gone: it may go now"


def test_a_start_leaves_another_process_download_in_progress(server, remotes, tmp_path):
    [one, _], [one_files, _] = remotes
    server.mode, server.match, server.method, server.seconds = "slow", "tier/one/adapter_model", "GET", 2.0
    try:
        downloader = child(tmp_path, one, one_files)
        deadline = time.monotonic() + 60
        while not any(p.name.startswith(".") for d in (tmp_path, tmp_path / HOME) if d.is_dir() for p in d.iterdir()):
            assert time.monotonic() < deadline and downloader.poll() is None, downloader.stderr.read()
            time.sleep(0.01)
        DiskTier(tmp_path, 10**9)  # a second process's start, while the first downloads
        assert downloader.stdout.readline() == "holding\n", downloader.stderr.read()
    finally:
        server.mode = server.method = None
    downloader.stdin.write("go\n")
    downloader.stdin.flush()
    assert downloader.stdout.readline() == "read whole\n" and downloader.wait() == 0
    assert one in DiskTier(tmp_path, 10**9)


def test_a_start_removes_what_an_ended_process_left(remotes, tmp_path):
    [one, _], _ = remotes
    tier = DiskTier(tmp_path, 10**9)
    with tier.local(one):
        pass
    key = next(p.name for p in (tmp_path / HOME).iterdir() if len(p.name) == 32)
    part, gone = tmp_path / HOME / f".{key}.part", tmp_path / HOME / f".{key}.{'0' * 32}.gone"
    for left in (part, gone):
        (left / "sub").mkdir(parents=True)
        (left / "sub" / "f").write_bytes(b"half")
    DiskTier(tmp_path, 10**9)
    assert not part.exists() and not gone.exists() and one in tier, "no live process held them"


# a manager registering url with its disk tier at root, where it cannot write: as nobody where the tests run
# as root (whom no mode bits stop), else with the tier's folder made read-only; prints the refusal
UNWRITABLE = """
import os, sys
sys.path.insert(0, sys.argv[3])
import obstore
from managers import one_node
from mstar.engine.resources.lora.disk_tier import HOME, DiskTier
from mstar.engine.resources.lora.manager import LoraManager
root, url = sys.argv[1], sys.argv[2]
DiskTier(root, 10**9)
m = one_node()
m = LoraManager(m.stores, m.pools, disk_tier=DiskTier(root, 10**9))
if os.geteuid() == 0:
    os.setgid(65534)
    os.setuid(65534)
else:
    os.chmod(os.path.join(root, HOME), 0o555)
try:
    m.register("x", url)
except ValueError as e:
    print(e)
"""


def refused_plainly(why: str, url: str, tier_home: Path) -> bool:
    """Whether a refusal names the adapter, its URL and a file, and no path of the tier's."""
    return (why.startswith(f"adapter 'x' ({url}") and ("adapter_config.json" in why or "adapter_model.safetensors"
            in why) and str(tier_home) not in why and ".part" not in why and ".lock" not in why)


def test_a_disk_tier_that_cannot_be_written_refuses_naming_adapter_url_and_file(remotes, tmp_path):
    [one, _], _ = remotes
    tmp_path.chmod(0o755)  # for nobody to reach it
    run = subprocess.run([sys.executable, "-c", UNWRITABLE, str(tmp_path), one.url, str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=300)
    why = run.stdout.strip()
    assert refused_plainly(why, one.url, tmp_path / HOME) and why.endswith("(Permission denied)"), why + run.stderr


def test_a_file_name_too_long_for_the_disk_refuses_naming_adapter_url_and_file(remotes, tmp_path):
    [one, _], _ = remotes
    from managers import one_node

    from mstar.engine.resources.lora.manager import LoraManager

    root = tmp_path
    while len(str(root / HOME)) < 4050 - 200:
        root = root / ("d" * 200)
    root = root / ("d" * (4050 - len(str(root / HOME)) - 1))  # the tier's folders fit; its files' paths do not
    m = one_node()
    m = LoraManager(m.stores, m.pools, disk_tier=DiskTier(root, 10**9))
    with pytest.raises(ValueError) as e:
        m.register("x", one.url)
    assert refused_plainly(str(e.value), one.url, root / HOME) and "(File name too long)" in str(e.value), str(e.value)
    m.close()


@pytest.mark.parametrize("mode", ["truncate", "down", "500"])
def test_a_download_failing_half_way_refuses_naming_adapter_url_and_file(server, remotes, tmp_path, mode):
    [_, two], _ = remotes
    from managers import one_node

    from mstar.engine.resources.lora.manager import LoraManager

    m = one_node()
    m = LoraManager(m.stores, m.pools, disk_tier=DiskTier(tmp_path, 10**9))
    server.mode, server.match, server.method = mode, "tier/two/adapter_model", "GET"
    try:
        with pytest.raises(ValueError) as e:
            m.register("x", two.url)
    finally:
        server.mode = server.method = None
    assert refused_plainly(str(e.value), two.url, tmp_path / HOME), str(e.value)
    assert [p.name for p in (tmp_path / HOME).iterdir()] == [], "nothing of it stays, not even its lock"
    m.close()


# a process racing others on root: two threads using the adapters at random (and evicting at random) under a
# budget of 0, each use checking the folder holds the pinned files whole; prints its failures, one a line
RACER = """
import hashlib, os, random, sys, threading
from mstar.engine.resources.lora import objects
from mstar.engine.resources.lora.disk_tier import DiskTier
root, seed, iterations, *sources = sys.argv[1:]
remotes = [objects.pin(u) for u in sources[::2]]
expected = [{f: hashlib.sha256((__import__("pathlib").Path(d) / f).read_bytes()).hexdigest()
             for f in ("adapter_config.json", "adapter_model.safetensors")} for d in sources[1::2]]
tier, failures = DiskTier(root, 0), []

def use(k):
    rng = random.Random(int(seed) * 10 + k)
    for _ in range(int(iterations)):
        j = rng.randrange(len(remotes))
        try:
            if rng.random() < 0.2:
                tier.evict(remotes[rng.randrange(len(remotes))])
            with tier.local(remotes[j]) as folder:
                got = {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in sorted(os.listdir(folder))}
                if got != expected[j]:
                    failures.append(f"adapter {j}: {sorted(got)} not as pinned")
        except Exception as e:
            failures.append(f"{type(e).__name__}: {e}")

threads = [threading.Thread(target=use, args=(k,)) for k in range(2)]
for t in threads: t.start()
for t in threads: t.join()
print("\\n".join(failures))
"""


def test_processes_racing_on_one_root_read_only_whole_folders_and_leave_nothing_behind(remotes, tmp_path):
    [one, two], folders = remotes
    sources = [str(x) for r, f in zip([one, two], folders, strict=True) for x in (r.url, f)]
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), str(seed), "150", *sources], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE) for seed in range(3)]
    while any(r.poll() is None for r in racers):
        DiskTier(tmp_path, 10**9)  # starting processes' sweeps meanwhile
    for r in racers:
        out, err = r.communicate()
        assert r.returncode == 0 and out.strip() == "", out + err
    assert os.listdir(tmp_path / HOME) == [], "no folder (budget 0), no lock, no temporary name left"


def test_a_tier_whose_folder_was_removed_under_it_makes_it_again(remotes, tmp_path):
    [one, _], [one_files, _] = remotes
    tier = DiskTier(tmp_path, 10**9)
    shutil.rmtree(tmp_path / HOME)  # a cache cleaned while the server runs
    assert tier.nbytes == 0 and one not in tier
    with tier.local(one) as folder:
        assert (folder / "adapter_model.safetensors").read_bytes() == \
            (one_files / "adapter_model.safetensors").read_bytes()
    assert one in tier
