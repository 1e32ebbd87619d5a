"""Reads whose system calls come back short, as a signal, or a run past Linux's 2 GiB a call, makes them:
each is read on from where it stopped, and what lands is what whole calls land, on every rank, with and
without a digest."""

from __future__ import annotations

import os

import pytest
import torch
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file, specs_from_config
from mstar.engine.resources.lora.source import FileSource, memory_at

CONFIG = model_config("llama", num_attention_heads=8, num_key_value_heads=8, head_dim=8)
SPEC = specs_from_config(CONFIG, max_rank=8)["language_model"]


class Short:
    """os.preadv giving at most cap bytes a call: the real call, over the views' first cap bytes."""

    def __init__(self, monkeypatch, cap: int) -> None:
        original, self.short = os.preadv, 0

        def preadv(fd, views, at):
            if sum(len(v) for v in views) <= cap:
                return original(fd, views, at)
            self.short += 1
            cut, left = [], cap
            for v in views:
                if left == 0:
                    break
                cut.append(v[:left])
                left -= len(cut[-1])
            return original(fd, cut, at)

        monkeypatch.setattr(os, "preadv", preadv)


def blocks(adapter) -> dict[str, bytes]:
    return {t: block.contiguous().view(torch.uint8).numpy().tobytes() for t, block in adapter.blocks.items()}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    _, path = make_adapter(tmp_path_factory.mktemp("short"), name="ad", r=4, config=CONFIG,
                           alpha_pattern={"down_proj": 3})
    return path, check_adapter_file(SPEC, "ad", path)


@pytest.mark.parametrize("cap", [1, 777, 4099])
@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (3, 8)])
def test_short_reads_land_what_whole_reads_land(adapter, monkeypatch, cap, rank, world_size):
    path, digest = adapter
    want = [LoraAdapterStore(SPEC, rank, world_size, pin=False).read("ad", path, d) for d in (None, digest)]
    short = Short(monkeypatch, cap)
    plain = LoraAdapterStore(SPEC, rank, world_size, pin=False).read("ad", path)
    store = LoraAdapterStore(SPEC, rank, world_size, pin=False)
    first, again = store.read("ad", path, digest), store.read("ad", path, digest)  # hashed, then fingerprinted
    assert short.short > 0
    assert blocks(plain) == blocks(want[0]) and plain.scaling == want[0].scaling
    for got in (first, again):
        assert blocks(got) == blocks(want[1]) and got.scaling == want[1].scaling and got.digest == digest


def test_a_file_that_ends_inside_a_short_read_is_refused(adapter, tmp_path, monkeypatch):
    """Short calls, then the end of the file: the read's next call gives nothing, and the read is refused."""
    path, _ = adapter
    file = tmp_path / "cut.bin"
    file.write_bytes((path / "adapter_model.safetensors").read_bytes()[:5000])
    Short(monkeypatch, 1000)
    source = FileSource(file)
    try:
        out = [memoryview(bytearray(3000)), memoryview(bytearray(0)), memoryview(bytearray(3000))]
        with pytest.raises(ValueError, match=r"^the file ended early: it was cut or rewritten since its header"):
            source.read_into(out, 0, 6000)
        source.read_into(out[:1], 0, 3000)
        assert bytes(out[0]) == file.read_bytes()[:3000]
    finally:
        source.close()


@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (1, 2), (3, 8)])
def test_each_runs_total_is_its_parts_bytes(adapter, rank, world_size):
    """The total a run carries is what its one call must return for the read to take it whole."""
    from mstar.engine.resources.lora.checkpoint import open_checkpoint
    from mstar.engine.resources.lora.plan import plan

    path, _ = adapter
    with open_checkpoint(path, "ad") as ckpt:
        p = plan(ckpt, LoraAdapterStore(SPEC, rank, world_size, pin=False).layout)
    runs = [run for b in (*p.batches, *p.staged_batches) for run in b]
    assert runs and all(total == sum(n for _, n in parts) for _, parts, total in runs)


def test_empty_parts_of_empty_memory_are_read_as_nothing(tmp_path):
    """A run's part may be empty, sliced from memory of no bytes (an empty staging buffer): read as nothing."""
    file = tmp_path / "f.bin"
    file.write_bytes(bytes(range(100)))
    source = FileSource(file)
    try:
        out = memoryview(bytearray(4))
        for views, nbytes in (([memory_at(0, 0)[0:0]], 0), ([out, memory_at(0, 0)], 4), ([memory_at(0, 0)], None)):
            source.read_into(views, 10, nbytes)
        assert bytes(out) == bytes(range(10, 14))
    finally:
        source.close()


def test_a_read_the_system_refuses_is_a_value_error(tmp_path):
    """os.preadv failing (here EINVAL: more views than one call takes; on a failing disk EIO) is a ValueError,
    which the read's refusal names its adapter and file with, never an OSError out of the reader."""
    file = tmp_path / "f.bin"
    file.write_bytes(bytes(5000))
    source = FileSource(file)
    try:
        views = [memoryview(bytearray(1)) for _ in range(os.sysconf("SC_IOV_MAX") + 1)]
        with pytest.raises(ValueError, match=r"^unreadable at offset 7 \(Invalid argument\)$"):
            source.read_into(views, 7)
    finally:
        source.close()
