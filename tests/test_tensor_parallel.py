"""A mixed batch through a two-rank tensor-parallel tiny Llama gives the single-process logits."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tiny import build_model, make_adapter, model_config

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.pool import LoraDevicePool
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file
from mstar.engine.resources.lora.tools.hf import TokenSlots, attach

CONFIG = model_config("llama", num_attention_heads=4, num_key_value_heads=2)
ROWS = ["x", None, "y", "x"]


def forward(rank: int, world_size: int, paths: dict, digests: dict, ids: torch.Tensor) -> torch.Tensor:
    """Check-free serving on one rank: store, pool, a model whose layers are sharded by the spec's rule."""
    spec = specs_from_config(CONFIG, max_rank=8)["language_model"]
    store = LoraAdapterStore(spec, rank, world_size, pin=False, dtype=torch.float32)
    pool = LoraDevicePool(spec, 2, rank=rank, world_size=world_size, dtype=torch.float32)
    for n in dict.fromkeys(r for r in ROWS if r):
        pool.activate(store.load(n, paths[n], digests[n]))
    model = build_model(CONFIG)
    slots = TokenSlots()
    attach(model, {"language_model": pool}, slots)
    slots.rows = torch.tensor([pool.slot_of(r) if r else -1 for r in ROWS])
    with torch.no_grad():
        return model(ids).logits


def run_rank(rank, world_size, rendezvous, paths, digests, ids, out):
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    logits = forward(rank, world_size, paths, digests, ids)
    everyone = [torch.empty_like(logits) for _ in range(world_size)]
    dist.all_gather(everyone, logits)
    if rank == 0:
        torch.save(everyone, out)
    dist.barrier()  # no rank tears its group down while another still talks to it (a gloo abort at exit)
    dist.destroy_process_group()


def test_two_rank_mixed_batch_matches_single_process(tmp_path):
    paths = {n: make_adapter(tmp_path, name=n, seed=i + 1, config=CONFIG, r=4 + 2 * i, alpha_pattern={"o_proj": 5})[1]
             for i, n in enumerate(["x", "y"])}
    spec = specs_from_config(CONFIG, max_rank=8)["language_model"]
    digests = {n: check_adapter_file(spec, n, p) for n, p in paths.items()}
    ids = torch.randint(1, 100, (len(ROWS), 8), generator=torch.Generator().manual_seed(0))
    want = forward(0, 1, paths, digests, ids)
    mp.spawn(run_rank, args=(2, f"file://{tmp_path}/rdv", paths, digests, ids, str(tmp_path / "out.pt")), nprocs=2)
    for rank, got in enumerate(torch.load(tmp_path / "out.pt")):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"rank {rank}")
    base = build_model(CONFIG)(ids).logits.detach()
    assert (want[0] - base[0]).abs().max() > 1e-3 and torch.allclose(want[1], base[1], atol=1e-5)
