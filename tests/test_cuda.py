"""The pool's GPU half, on a GPU: pinned host memory, asynchronous activation, the side stream's order, and the
Triton kernels against PEFT in bfloat16, inside a CUDA graph and without a host synchronisation. Skipped without
CUDA (scripts/gpu-check.sh runs them on a lent GPU)."""

from __future__ import annotations

import pytest
import torch
from test_kernels import check, mixed, serve
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import LoraAdapterStore, LoraDevicePool, add_lora, specs_from_config
from mstar.engine.resources.lora.apply import default_backend, triton_installed
from mstar.engine.resources.lora.batch import LoraBatch
from mstar.engine.resources.lora.manager import LoraManager, Request

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_triton = pytest.mark.skipif(not triton_installed(), reason="triton is not installed")

CONFIG = model_config("llama", hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=64)  # about 1 MB of rank-8 weights a layer: copies that take a measurable while
SLEEP = 1 << 30  # GPU cycles: about half a second at H200 clocks, far longer than anything the host does here


def spec(**over):
    return specs_from_config(CONFIG, max_rank=8, **over)["language_model"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda")
    return {n: make_adapter(root, name=n, seed=i + 1, config=CONFIG, r=8)[1] for i, n in enumerate("ab")}


def test_pinned_host_memory_is_registered_and_released(paths):
    store = LoraAdapterStore(spec(), pin=True)
    ad = store.load("a", paths["a"])
    block = next(iter(ad.blocks.values()))
    assert block.is_pinned(), "the host copy is page-locked, so its copy to the device is asynchronous"
    start, size = block.untyped_storage().data_ptr(), block.untyped_storage().nbytes()
    already = int(torch.cuda.cudart().cudaHostRegister(start, size, 0))
    assert already == 712, f"registered already (cudaErrorHostMemoryAlreadyRegistered), not {already}"
    del ad, block
    store.drop("a")
    store.trim()
    assert store.mapped_bytes == 0, "unregistered and unmapped once nothing views it"
    torch.cuda.synchronize()  # no error left behind by the unregistration


def test_activation_from_pinned_memory_is_asynchronous_and_from_pageable_memory_is_not(paths):
    pool = LoraDevicePool(spec(), 2, "cuda")
    for pin, slot_free in ((True, False), (False, True)):
        ad = LoraAdapterStore(spec(), pin=pin).read("a", paths["a"])
        pool.deactivate("a")
        torch.cuda._sleep(SLEEP)
        slot = pool.activate(ad)
        assert torch.cuda.current_stream().query() == slot_free, \
            f"pin={pin}: activate returned {'after' if slot_free else 'before'} the queued work ran"
        torch.cuda.synchronize()
        for t in ad.a:
            assert torch.equal(pool.a[t][slot].cpu(), ad.a[t]) and torch.equal(pool.b[t][slot].cpu(), ad.b[t])
        assert torch.equal(pool.ranks["qkv_proj"][slot].cpu(), ad.ranks["qkv_proj"])


def test_the_side_stream_runs_after_the_last_forward_and_the_next_waits_on_ready(paths):
    m = LoraManager.build(CONFIG, max_rank=8, host_capacity=4, slots=1, device="cuda", pin=True)
    m.register_all(paths)
    pool, store = m.pools["language_model"], m.stores["language_model"]
    step = m.step([], [Request(1, "a")])
    m.wait_for_reads()
    step = m.step([], [Request(1, "a")])
    assert step.admitted == [1]
    torch.cuda.current_stream().wait_event(step.ready)
    m.prefetch([Request(2, "b")])
    m.wait_for_reads()
    torch.cuda._sleep(SLEEP)  # the forward that reads a's slot, still running when the next step comes
    seen = pool.a["qkv_proj"][0].clone()
    step = m.step([], [Request(2, "b")])
    assert step.admitted == [2] and step.slot[2] == 0, "b takes a's slot: a's request is done"
    assert not step.ready.query(), "b's copy waits for the forward that reads the slot"
    torch.cuda.current_stream().wait_event(step.ready)  # the next forward
    after = pool.a["qkv_proj"][0].clone()
    torch.cuda.synchronize()
    a, b = (store.get(m.registry.resolve(n).key) for n in "ab")
    assert torch.equal(seen.cpu(), a.a["qkv_proj"]), "the forward read a's weights, not b's arriving"
    assert torch.equal(after.cpu(), b.a["qkv_proj"]), "the next forward read b's"
    m.close()


@needs_triton
def test_the_default_backend_on_cuda_is_triton():
    assert default_backend(torch.device("cuda")) == "triton" and default_backend(torch.device("cpu")) == "torch"


@needs_triton
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_kernels_give_peft_delta_in_bf16(tmp_path_factory, shape):
    pms, pools, slot_of = serve(tmp_path_factory.getbasetemp(), "qwen2_vl", torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    per_token, slots = mixed(slot_of, 37 if shape == "decode" else 700, g, runs=shape == "prefill")
    for pool in pools.values():
        batch = LoraBatch.build(slots, pool.slots)
        for target in pool.spec.targets:
            check(pool, pms, per_token, batch, target, 0, torch.bfloat16, g)


@needs_triton
def test_kernels_replay_in_a_cuda_graph_and_never_synchronise(tmp_path_factory):
    _, pools, slot_of = serve(tmp_path_factory.getbasetemp(), "llama", torch.bfloat16)
    pool = pools["language_model"]
    g = torch.Generator().manual_seed(2)
    mixes = [mixed(slot_of, 24, g)[1], mixed(slot_of, 24, g)[1], torch.full((24,), -1, device="cuda")]
    slots = mixes[0].clone()
    x = torch.randn(24, 64, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros(24, 128, device="cuda", dtype=torch.bfloat16)

    def forward():  # one LoraBatch for the step, read by every layer
        batch = LoraBatch.build(slots, pool.slots)
        out.zero_()
        for layer in range(3):
            add_lora(out, x, pool, "qkv_proj", layer, batch, backend="triton")

    forward()  # compiles the kernels and builds the slice tables before the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for mix in mixes:
        slots.copy_(mix)
        graph.replay()
        want = torch.zeros_like(out)
        for layer in range(3):
            add_lora(want, x, pool, "qkv_proj", layer, mix, backend="torch")
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
