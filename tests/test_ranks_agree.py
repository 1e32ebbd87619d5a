"""Ranks that make the same hold / put / drop calls hold the same adapters, whatever order reads land in."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tiny import make_adapter, model_config

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file

CONFIG = model_config("llama", num_attention_heads=4, num_key_value_heads=2)
NAMES = ["a", "b", "c", "d", "e"]


def schedule(seed: int) -> list[tuple[str, str]]:
    """The calls every rank makes, in order: the engine's scheduler decides these, the same everywhere."""
    rng = random.Random(seed)
    return [("drop" if rng.random() < 0.15 else "hold", rng.choice(NAMES)) for _ in range(60)]


def run_rank(rank: int, world_size: int, rendezvous: str, paths: dict[str, str], digests: dict[str, bytes],
             out: str) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    spec = specs_from_config(CONFIG, max_rank=8, capacity=3)["language_model"]
    store = LoraAdapterStore(spec, rank, world_size, pin=False)
    rng = random.Random(1000 + rank)  # each rank's reads land in its own random order

    def read_then_put(name: str) -> None:
        adapter = store.read(name, paths[name], digests[name])
        time.sleep(rng.random() * 0.02)
        store.put(adapter)

    with ThreadPoolExecutor(4) as pool:
        for op, name in schedule(7):
            if op == "drop":
                store.drop(name)
            elif store.hold(name):
                pool.submit(read_then_put, name)
            time.sleep(rng.random() * 0.003)
    mine = (store.held(), {n: store.get(n).digest.hex() for n in store.held() if store.get(n) is not None})
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        torch.save(everyone, out)
    dist.barrier()  # no rank tears its group down while another still talks to it (a gloo abort at exit)
    dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_hold_the_same_adapters_without_talking(tmp_path, world_size):
    paths = {n: str(make_adapter(tmp_path, name=n, seed=i, config=CONFIG)[1]) for i, n in enumerate(NAMES)}
    spec = specs_from_config(CONFIG, max_rank=8)["language_model"]
    digests = {n: check_adapter_file(spec, n, p) for n, p in paths.items()}
    out = tmp_path / "held.pt"
    mp.spawn(run_rank, args=(world_size, f"file://{tmp_path}/rdv", paths, digests, str(out)), nprocs=world_size)
    everyone = torch.load(out)
    held, copies = everyone[0]
    assert 0 < len(held) <= 3 and set(copies) == set(held), "every held adapter's copy is in once reads finish"
    assert all(e == everyone[0] for e in everyone), f"ranks disagree: {everyone}"
    assert all(copies[n] == digests[n].hex() for n in held), "each copy is the adapter checked under its name"
