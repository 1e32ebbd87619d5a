"""What a cold read leaves the cyclic garbage collector: entries and what is derived from them untracked
(acyclic.py), and the collector held off while a header is parsed and restored as the host had it, from
threads reading at once and on errors (header_json.no_collection)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from moe import per_expert_adapter, specs
from safetensors import safe_open
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file, specs_from_config
from mstar.engine.resources.lora import safetensors_header as sh
from mstar.engine.resources.lora.checkpoint import open_checkpoint
from mstar.engine.resources.lora.header_json import no_collection


def _tracked() -> int:
    """Objects the collector tracks once settled: it untracks a plain tuple of integers when a pass first visits
    it, and a tuple of such tuples (a plan's runs of parts) on the pass after, as the host's own passes do."""
    gc.collect()
    gc.collect()
    return len(gc.get_objects())


def test_a_held_per_expert_header_leaves_the_collector_almost_nothing_per_tensor(tmp_path):
    """Both nodes' reads of a per-expert adapter (thousands of tensors) keep its header and what is derived
    from it (modules, locations, plans) cached, yet add to the collector's objects a small fraction of one
    per tensor; every entry is untracked and says what the safetensors library says of its tensor."""
    tensors, path = per_expert_adapter(tmp_path, "qwen3_moe", experts=range(64), layers=32)
    s = specs("qwen3_moe", num_experts=64, num_hidden_layers=32)
    sh._HEADERS.clear()
    digest = check_adapter_file(s["language_model"], "pe", path, [s["experts"]])
    stores = [LoraAdapterStore(s[n], pin=False, dtype=torch.float32) for n in ("language_model", "experts")]
    before = _tracked()
    adapters = [store.read("pe", path, digest) for store in stores]
    sh._HEADERS.clear()  # the reads' header parsed anew, and all derived from it again
    adapters = [store.read("pe2", path, digest) for store in stores]
    added = _tracked() - before
    assert added < len(tensors) / 20, (added, len(tensors))
    header = open_checkpoint(path).header
    assert len(header.tensors) == len(tensors) > 10_000
    assert not any(map(gc.is_tracked, header.tensors.values()))
    with safe_open(path / "adapter_model.safetensors", "pt") as f:
        for key, entry in header.tensors.items():
            assert list(entry.shape) == f.get_slice(key).get_shape()
            assert entry.dtype == f.get_slice(key).get_dtype()
    assert all(a is not None for a in adapters)


def test_untracked_entries_are_freed_with_their_header_and_equal_a_walk_of_the_file(tmp_path):
    """A real PEFT adapter's header parsed twice (cache emptied between): equal entries, none tracked; once the
    cache and the checkpoints let go, the collector's count is back where it was."""
    _, path = make_adapter(tmp_path, "llama")
    sh._HEADERS.clear()
    before = _tracked()
    first = dict(open_checkpoint(path).header.tensors)
    sh._HEADERS.clear()
    second = open_checkpoint(path).header.tensors
    assert first == second and not any(map(gc.is_tracked, second.values()))
    with safe_open(path / "adapter_model.safetensors", "pt") as f:
        assert sorted(first) == sorted(f.keys())
    del first, second
    sh._HEADERS.clear()
    assert _tracked() <= before


@pytest.fixture
def collector():
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def _threads(n: int, body) -> list[BaseException]:
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            body(i)
        except BaseException as e:  # reported to the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def test_reads_on_four_threads_hold_the_collector_off_until_the_last_ends(collector):
    """Four threads inside no_collection at once, leaving one by one: the collector stays off while any is
    inside (one leaving does not turn it back on under the others) and is on once all have left."""
    inside, leave = threading.Barrier(4), [threading.Event() for _ in range(4)]
    seen: list[tuple[int, bool]] = []

    def body(i: int) -> None:
        with no_collection():
            inside.wait(10)
            leave[i].wait(10)
        seen.append((i, gc.isenabled()))  # after this thread's read, the others' still under way but the last
        if i < 3:
            leave[i + 1].set()

    errors: list[BaseException] = []
    runner = threading.Thread(target=lambda: errors.extend(_threads(4, body)))
    runner.start()
    leave[0].set()
    runner.join(30)
    assert not errors
    assert seen == [(0, False), (1, False), (2, False), (3, True)]
    assert gc.isenabled()


def test_a_read_leaves_the_collector_off_where_the_host_had_it_off(collector):
    """A host that runs with the collector off finds it off after reads on four threads at once, and after a
    read that failed."""
    gc.disable()
    barrier = threading.Barrier(4)

    def body(_: int) -> None:
        with no_collection():
            barrier.wait(10)
            assert not gc.isenabled()

    assert not _threads(4, body)
    assert not gc.isenabled()
    with pytest.raises(ValueError), no_collection():
        raise ValueError("a refused header")
    assert not gc.isenabled()


def test_a_refused_header_on_one_thread_restores_the_collector_for_all(tmp_path, collector):
    """Cold reads on four threads, one of a file that is refused: each refusal raised in its thread, the
    others read, and the collector is on afterwards as it was before."""
    _, path = make_adapter(tmp_path, "llama")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_bytes((path / "adapter_config.json").read_bytes())
    data = (path / "adapter_model.safetensors").read_bytes()
    (bad / "adapter_model.safetensors").write_bytes(data[:-1])
    spec = specs_from_config(model_config("llama"), max_rank=16)["language_model"]
    stores = [LoraAdapterStore(spec, pin=False) for _ in range(4)]
    barrier = threading.Barrier(4)

    def body(i: int) -> None:
        barrier.wait(10)
        sh._HEADERS.clear()
        if i == 0:
            with pytest.raises(ValueError, match="bad"):
                stores[i].read("bad", bad)
        else:
            assert stores[i].read(f"ad{i}", path) is not None

    assert not _threads(4, body)
    assert gc.isenabled()


def test_a_pushed_adapters_entries_are_untracked_and_its_copy_equals_the_files(tmp_path):
    """A real PEFT adapter pushed from memory (as an RL loop syncs one): its header's entries untracked, as a
    file's are, and the copy it serves equal to the file's, byte for byte."""
    import json

    from safetensors.torch import load_file

    from mstar.engine.resources.lora.memory import tensor_checkpoint

    _, path = make_adapter(tmp_path, "llama")
    tensors = load_file(path / "adapter_model.safetensors")
    config = json.loads((path / "adapter_config.json").read_text())
    spec = specs_from_config(model_config("llama"), max_rank=16)["language_model"]
    pushed = LoraAdapterStore(spec, pin=False).read_tensors("pushed", tensors, config)
    read = LoraAdapterStore(spec, pin=False).read("read", path)
    ckpt = tensor_checkpoint("pushed", tensors, config)
    assert ckpt.header.tensors and not any(map(gc.is_tracked, ckpt.header.tensors.values()))
    assert (pushed.rank, pushed.scaling) == (read.rank, read.scaling) and pushed.a.keys() == read.a.keys()
    for mine, theirs in ((pushed.a, read.a), (pushed.b, read.b)):
        for target in mine:
            assert torch.equal(mine[target].view(torch.uint8), theirs[target].view(torch.uint8)), target


def test_a_warm_read_of_thousands_of_parts_sets_off_no_collection(tmp_path):
    """The views a per-expert read lands its thousands of parts in are made with the collector held off, so a
    warm read sets off none of its passes over the host's heap (in a process of 200,000 tracked objects one
    full pass cost 90-100 ms, 2.5x the read); the read serves what a read from a collected heap serves."""
    tensors, path = per_expert_adapter(tmp_path, "qwen3_moe", experts=range(64), layers=8)
    s = specs("qwen3_moe", num_experts=64, num_hidden_layers=8)
    store = LoraAdapterStore(s["experts"], pin=False, dtype=torch.float32)
    want = store.read("pe", path)
    passes = []

    def count(phase, info):
        if phase == "start":
            passes.append(info["generation"])

    threshold = gc.get_threshold()
    gc.collect()
    gc.set_threshold(50, 10, 10)  # a pass every 50 objects made: the reader's 6,144 views would set off 120
    gc.callbacks.append(count)
    try:
        got = store.read("pe", path)
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
    assert len(tensors) > 2000 and len(passes) < 10 and not any(passes), passes  # a young pass or two, no more
    assert all(torch.equal(got.blocks[t], want.blocks[t]) for t in want.blocks)
