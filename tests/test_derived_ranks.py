"""A mixed batch through a two-rank tensor-parallel tiny model of a family no builder knows (Granite), served
by the spec derived from it: every rank's logits are the single process's, and those are PEFT's."""

from __future__ import annotations

import peft
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from derived import all_linear_adapter, build, tiny_config

from mstar.engine.resources.lora import LoraAdapterStore, LoraDevicePool, check_adapter_file, specs_from_config
from mstar.engine.resources.lora.tools.hf import TokenSlots, attach

ROWS = ["x", None, "y", "x"]


def config():
    return tiny_config("granite", num_hidden_layers=2)


def forward(rank: int, world_size: int, paths: dict, ids: torch.Tensor) -> torch.Tensor:
    spec = specs_from_config(config().to_dict(), max_rank=4)["language_model"]
    digests = {n: check_adapter_file(spec, n, p) for n, p in paths.items()}
    store = LoraAdapterStore(spec, rank, world_size, pin=False, dtype=torch.float32)
    pool = LoraDevicePool(spec, 2, rank=rank, world_size=world_size, dtype=torch.float32)
    for n, p in paths.items():
        pool.activate(store.load(n, p, digests[n]))
    model = build(config())
    slots = TokenSlots()
    assert attach(model, {"language_model": pool}, slots)
    slots.rows = torch.tensor([pool.slot_of(r) if r else -1 for r in ROWS])
    with torch.no_grad():
        return model(ids).logits


def run_rank(rank, world_size, rendezvous, paths, ids, out):
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    logits = forward(rank, world_size, paths, ids)
    everyone = [torch.empty_like(logits) for _ in range(world_size)]
    dist.all_gather(everyone, logits)
    if rank == 0:
        torch.save(everyone, out)
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_serve_a_derived_spec_as_one_process_and_peft_do(tmp_path):
    paths = {n: all_linear_adapter(tmp_path, build(config()), name=n, seed=i + 1)[1] for i, n in enumerate("xy")}
    ids = torch.randint(1, 60, (len(ROWS), 6), generator=torch.Generator().manual_seed(0))
    want = forward(0, 1, paths, ids)
    mp.spawn(run_rank, args=(2, f"file://{tmp_path}/rdv", paths, ids, str(tmp_path / "out.pt")), nprocs=2)
    for rank, got in enumerate(torch.load(tmp_path / "out.pt")):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"rank {rank}")
    with torch.no_grad():
        for row, name in enumerate(ROWS):
            model = build(config())
            if name is not None:
                model = peft.PeftModel.from_pretrained(model, paths[name]).eval()
            torch.testing.assert_close(want[row], model(ids[row : row + 1]).logits[0], rtol=1e-4, atol=1e-4,
                                       msg=f"row {row} ({name})")
