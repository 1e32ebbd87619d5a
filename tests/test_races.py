"""What is served is what was checked, while files and tensors change under the read.

A read with a digest returns exactly the weights that hashed to it, or a ValueError: never another
version's, never a mix. Each race is injected at the worst moment once (the file replaced or cut just
after its header was read), then looped with real threads so the moments in between are tried too.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from peft.utils import get_peft_model_state_dict
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file, specs_from_config
from mstar.engine.resources.lora.check import check_adapter_tensors
from mstar.engine.resources.lora.source import FileSource

SPEC = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
WEIGHTS = "adapter_model.safetensors"


def store(**kw) -> LoraAdapterStore:
    return LoraAdapterStore(SPEC, pin=False, dtype=torch.float32, **kw)


def same(x, y) -> bool:
    return set(x.a) == set(y.a) and all(torch.equal(x.a[t], y.a[t]) and torch.equal(x.b[t], y.b[t]) for t in x.a)


def race(disturb, read, right, seed: int, least: int, most: int, seconds: float = 0, refused: str = "") -> None:
    """read(i) called while disturb(rng) runs over and over on a thread, for seconds and at least least
    times, at most most: every read that returns is right, every refusal a ValueError saying refused, and
    both happen (else the race was not run)."""
    stop, outcomes, wrong = threading.Event(), {"served": 0, "refused": 0}, []

    def disturbing():
        rng = random.Random(seed)
        while not stop.is_set():
            disturb(rng)

    t = threading.Thread(target=disturbing)
    t.start()
    try:
        deadline = time.monotonic() + seconds
        for i in range(most):
            if i >= least and time.monotonic() >= deadline:
                break
            try:
                got = read(i)
            except ValueError as e:
                assert refused in str(e)
                outcomes["refused"] += 1
                continue
            outcomes["served"] += 1
            if not right(got):
                wrong.append(got)
    finally:
        stop.set()
        t.join()
    assert not wrong, f"{len(wrong)} reads served other weights under the digest ({outcomes})"
    assert outcomes["served"] and outcomes["refused"], f"the race was not run: {outcomes}"


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Two versions of one adapter, same shapes and config, other weights: (path served, v1, v2, d1, and each
    version's layout as a store reads it)."""
    tmp = tmp_path_factory.mktemp("versions")
    v1 = make_adapter(tmp, name="v1", seed=1, r=8)[1]
    v2 = make_adapter(tmp, name="v2", seed=2, r=8)[1]
    served = tmp / "served"
    shutil.copytree(v1, served)
    d1 = check_adapter_file(SPEC, "ad", served)
    layouts = {v: store().read("ad", v) for v in (v1, v2)}
    assert not same(layouts[v1], layouts[v2])
    return served, v1, v2, d1, layouts


class AfterHeader:
    """Runs act once, right after the first read of a file's header (the 8-byte length), and before
    anything else of it is read: the worst moment for a new version to land."""

    def __init__(self, monkeypatch, act):
        self.done = False
        original = FileSource.read

        def read(source, nbytes, at):
            data = original(source, nbytes, at)
            if at == 8 and not self.done:
                self.done = True
                act()
            return data

        monkeypatch.setattr(FileSource, "read", read)


def restore(path: Path, v1: Path) -> None:
    tmp = path.with_suffix(".restore")
    shutil.copyfile(v1 / WEIGHTS, tmp)
    os.replace(tmp, path / WEIGHTS)


def test_a_version_renamed_in_after_the_header_is_not_served_under_the_old_digest(versions, monkeypatch):
    served, v1, v2, d1, layouts = versions
    try:
        tmp = served / "new.tmp"
        shutil.copyfile(v2 / WEIGHTS, tmp)
        AfterHeader(monkeypatch, lambda: os.replace(tmp, served / WEIGHTS))
        got = store().read("ad", served, d1)
        assert same(got, layouts[v1]), "the open file is the old version, read whole"
        with pytest.raises(ValueError, match=r"adapter 'ad'.*the file changed since"):
            store().read("ad", served, d1)  # the path now names v2
    finally:
        restore(served, v1)


def test_a_file_rewritten_in_place_after_the_header_is_refused(versions, monkeypatch):
    served, v1, v2, d1, _ = versions
    try:
        new = (v2 / WEIGHTS).read_bytes()

        def rewrite():
            with open(served / WEIGHTS, "r+b") as f:
                f.write(new)

        AfterHeader(monkeypatch, rewrite)
        with pytest.raises(ValueError, match=r"adapter 'ad'.*the file changed since"):
            store().read("ad", served, d1)
    finally:
        restore(served, v1)


@pytest.mark.parametrize("when", ["check", "read", "read with digest"])
def test_a_file_cut_after_its_header_was_read_is_refused(versions, monkeypatch, when):
    served, v1, _, d1, _ = versions
    try:
        size = (served / WEIGHTS).stat().st_size
        AfterHeader(monkeypatch, lambda: os.truncate(served / WEIGHTS, size // 2))
        with pytest.raises(ValueError, match=r"adapter 'ad' \(.*\): .*(ended early|changed size)"):
            if when == "check":
                check_adapter_file(SPEC, "ad", served)
            else:
                store().read("ad", served, d1 if when == "read with digest" else None)
    finally:
        restore(served, v1)


def test_a_file_deleted_after_its_header_was_read_is_read_whole_from_the_open_file(versions, monkeypatch):
    served, v1, _, d1, layouts = versions
    try:
        AfterHeader(monkeypatch, lambda: os.unlink(served / WEIGHTS))
        assert same(store().read("ad", served, d1), layouts[v1])
        with pytest.raises(ValueError, match=r"adapter 'ad'.*no adapter_model.safetensors"):
            store().read("ad", served, d1)
    finally:
        restore(served, v1)


def test_reads_racing_renames_and_rewrites_serve_the_checked_weights_or_refuse(versions):
    """A writer thread publishes v2 by rename and rewrites v1 in place, at random moments, while reads with
    v1's digest run: every read that returns has v1's weights exactly."""
    served, v1, v2, d1, layouts = versions
    old, new = (v1 / WEIGHTS).read_bytes(), (v2 / WEIGHTS).read_bytes()
    s = store()

    def writer(rng):
        tmp = served / f"w{rng.random()}.tmp"
        tmp.write_bytes(new if rng.random() < 0.5 else old)
        time.sleep(rng.random() * 2e-3)
        if rng.random() < 0.5:
            os.replace(tmp, served / WEIGHTS)
        else:  # in place, torn on purpose: the first half only, then the rest
            data = tmp.read_bytes()
            tmp.unlink()
            with open(served / WEIGHTS, "r+b") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                time.sleep(rng.random() * 1e-3)
                f.write(data[len(data) // 2 :])
        time.sleep(rng.random() * 2e-3)

    try:
        race(writer, lambda i: s.read("ad", served, d1), lambda got: same(got, layouts[v1]), seed=0, least=500,
             most=3001, seconds=6)
    finally:
        restore(served, v1)


def test_pushed_tensors_stepped_during_reads_serve_the_pushed_weights_or_refuse(tmp_path):
    """An optimizer steps the pushed tensors in place (and puts them back) while reads with the push's
    digest run: every read that returns has the pushed weights exactly."""
    pm, _ = make_adapter(tmp_path, r=8)
    tensors, config = get_peft_model_state_dict(pm), pm.peft_config["default"]
    tensors = {k: v.clone() for k, v in tensors.items()}
    original = {k: v.clone() for k, v in tensors.items()}
    digest = check_adapter_tensors(SPEC, "ad", tensors, config)
    s = store()
    want = s.read_tensors("ad", tensors, config, digest)

    def optimizer(rng):
        for k in rng.sample(sorted(tensors), 3):
            tensors[k].mul_(1.01)
        time.sleep(rng.random() * 1e-3)
        for k, v in original.items():
            tensors[k].copy_(v)
        time.sleep(rng.random() * 1e-3)

    race(optimizer, lambda i: s.read_tensors("ad", tensors, config, digest), lambda got: same(got, want), seed=1,
         least=1500, most=1500, refused="the tensors changed since they were pushed")


def test_a_negative_view_pushed_serves_its_values(tmp_path):
    """torch._neg_view keeps the negation in a bit, not in memory: hashed or copied as memory, +B and -B
    would share a digest."""
    pm, _ = make_adapter(tmp_path, r=4)
    tensors, config = get_peft_model_state_dict(pm), pm.peft_config["default"]
    key = next(k for k in tensors if "lora_B" in k)
    negated = {**tensors, key: torch._neg_view(-tensors[key])}  # the same values, held negated
    assert negated[key].is_neg() and torch.equal(negated[key], tensors[key])
    flipped = {**tensors, key: torch._neg_view(tensors[key])}  # other values, the same memory
    d = check_adapter_tensors(SPEC, "ad", tensors, config)
    assert check_adapter_tensors(SPEC, "ad", negated, config) == d
    assert check_adapter_tensors(SPEC, "ad", flipped, config) != d
    s = store()
    assert same(s.read_tensors("ad", negated, config), s.read_tensors("ad", tensors, config))
    assert same(s.read_tensors("ad", negated, config, d), s.read_tensors("ad", tensors, config, d))


def test_a_file_cut_under_the_startup_check_and_reads_never_kills_the_process(versions, tmp_path):
    """Truncated while it is hashed and read, over and over: refusals, never a SIGBUS (the process would die
    with it, so the loop runs in a child)."""
    _, v1, _, _, _ = versions
    path = tmp_path / "cut"
    shutil.copytree(v1, path)
    code = f"""
import os, threading, shutil, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import torch
from test_races import SPEC
from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file
path = {str(path)!r}
good = open({str(v1 / WEIGHTS)!r}, "rb").read()
store = LoraAdapterStore(SPEC, 0, 2, pin=False)
stop = threading.Event()
def cutter():
    import random
    rng = random.Random(0)
    while not stop.is_set():
        with open(path + "/adapter_model.safetensors", "wb") as f:
            f.write(good)
        os.truncate(path + "/adapter_model.safetensors", rng.randrange(len(good)))
t = threading.Thread(target=cutter); t.start()
refused = 0
try:
    for i in range(300):
        try:
            digest = check_adapter_file(SPEC, "ad", path)
            store.read("ad", path, digest)
            store.read("ad", path)
        except ValueError:
            refused += 1
finally:
    stop.set(); t.join()
print("refused", refused)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) > 0


def test_alpha_tensors_rewritten_during_reads_serve_the_hashed_scalings_or_refuse(tmp_path):
    """A trainer's file keeps each module's alpha in a tensor of its own: the scalings served must be those of
    the alpha bytes that hashed to the digest, whichever path the read takes (the first, hashing every byte,
    or a later one, checking fingerprints)."""
    from safetensors.torch import load_file, save_file

    _, path = make_adapter(tmp_path, r=8, target_modules=["q_proj", "v_proj"])
    tensors = {k.removeprefix("base_model.model."): v for k, v in load_file(path / WEIGHTS).items()}
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in tensors})
    file = tmp_path / "trainer.safetensors"

    def write(alpha):
        save_file({**tensors, **{f"{m}.alpha": torch.tensor(alpha if i % 2 else 16.0) for i, m in enumerate(modules)}},
                  file)

    write(4.0)
    d1 = check_adapter_file(SPEC, "ad", file)
    want = store().read("ad", file, d1)
    write(32.0)
    other = file.read_bytes()
    write(4.0)
    first = file.read_bytes()
    shared = store()

    def writer(rng):
        with open(file, "r+b") as f:  # same size, same header: only the alpha bytes differ
            f.write(other if rng.random() < 0.5 else first)
        time.sleep(rng.random() * 1e-3)

    race(writer, lambda i: (shared if i % 2 else store()).read("ad", file, d1),
         lambda got: same(got, want) and got.scaling == want.scaling, seed=3, least=1500, most=1500)


def test_a_read_of_a_huge_file_takes_no_more_memory_than_its_layout(tmp_path):
    """A file far larger than what this node reads (a sparse 1 GB tensor no spec maps) is hashed through
    bounded buffers: refused for its digest without holding the file in memory."""
    import json
    import struct

    _, path = make_adapter(tmp_path, target_modules=["q_proj"])
    digest = check_adapter_file(SPEC, "ad", path)
    raw = (path / WEIGHTS).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    huge = 1 << 30
    header["vision.blocks.0.qkv.lora_A.weight"] = {"dtype": "U8", "shape": [huge], "data_offsets": [end, end + huge]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path / WEIGHTS, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + raw[8 + n :])
        f.truncate(8 + len(text) + end + huge)  # sparse: no disk, and reads as zeros
    from pathlib import Path as P

    def peak_kb():
        return int(next(line for line in P("/proc/self/status").read_text().splitlines()
                        if line.startswith("VmHWM")).split()[1])

    before = peak_kb()
    with pytest.raises(ValueError, match=r"adapter 'ad'.*the file changed since"):
        store().read("ad", path, digest)
    assert peak_kb() - before < 200_000, "the read held the file in memory"
