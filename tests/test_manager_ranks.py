"""Ranks running the same scheduler through their managers admit and fail the same requests in every step,
whatever order and pace their reads land in, and though one rank cannot read one adapter."""

from __future__ import annotations

import os
import random
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import LoraAdapterStore, LoraDevicePool, specs_from_config
from mstar.engine.resources.lora.manager import LoraManager, Request

CONFIG = model_config("llama", num_attention_heads=4, num_key_value_heads=2)
NAMES = ["a", "b", "c", "d", "e"]
BROKEN = ("c", 1)  # this adapter's reads fail on this rank alone


class UnevenDisk(LoraAdapterStore):
    """Reads that take a random while, different on every rank, and one that fails on one rank."""

    def read(self, name, path, digest=None):
        time.sleep(self.rng.random() * 0.03)
        if (name, self.rank) == BROKEN:
            raise ValueError(f"adapter {name!r} ({path}): an I/O error on rank {self.rank}")
        return super().read(name, path, digest)


def scheduler(m: LoraManager, steps: int) -> tuple[list, int]:
    """The engine's scheduler, the same on every rank: arrivals for steps steps, admissions, requests
    finishing, until the queue has drained; each step's decisions, and how many requests arrived."""
    rng = random.Random(5)
    queue: list[Request] = []
    running: dict[int, list] = {}
    log, next_id = [], 0
    for t in range(steps + 400):
        if t >= steps and not queue:  # arrivals are over and the queue has drained
            break
        for _ in range(rng.randint(0, 2) if t < steps else 0):
            queue.append(Request(next_id, rng.choice([*NAMES, None])))
            next_id += 1
        step = m.step([r for r, _ in running.values()], queue)
        names = {r.id: r.adapter for r in queue}
        log.append((t, [(rid, names[rid], step.slot[rid]) for rid in step.admitted],
                    {rid: str(e) for rid, e in step.failed.items()}))
        for r in queue:
            if r.id in step.admitted:
                running[r.id] = [r, rng.randint(1, 4)]
        queue = [r for r in queue if r.id not in step.admitted and r.id not in step.failed]
        for rid in list(running):
            running[rid][1] -= 1
            if running[rid][1] == 0:
                del running[rid]
        time.sleep(0.004)  # the forward
    return log, next_id


def run_rank(rank: int, world_size: int, rendezvous: str, paths: dict, out: str) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    spec = specs_from_config(CONFIG, max_rank=8, capacity=3)["language_model"]
    store = UnevenDisk(spec, rank, world_size, pin=False)
    store.rng = random.Random(100 + rank)
    pool = LoraDevicePool(spec, 2, rank=rank, world_size=world_size)
    m = LoraManager({"language_model": store}, {"language_model": pool}, group=dist.group.WORLD)
    m.register_all(paths)
    log = scheduler(m, 60)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, log)
    if rank == 0:
        torch.save(everyone, out)
    m.close()
    dist.barrier()  # no rank tears its group down while another still talks to it (a gloo abort at exit)
    dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_admit_and_fail_alike_in_every_step(tmp_path, world_size):
    paths = {n: str(make_adapter(tmp_path, name=n, seed=i, config=CONFIG)[1]) for i, n in enumerate(NAMES)}
    out = tmp_path / "log.pt"
    ctx = mp.start_processes(run_rank, args=(world_size, f"file://{tmp_path}/rdv", paths, str(out)),
                             nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        assert time.monotonic() < deadline, "a rank hung"
    everyone = torch.load(out)
    assert all(log == everyone[0] for log in everyone), "every rank decided the same in every step"
    log, arrived = everyone[0]
    failed = {rid: why for _, _, f in log for rid, why in f.items()}
    admitted = [name for _, a, _ in log for _, name, _ in a]
    assert failed and all("adapter 'c'" in why and "an I/O error on rank 1" in why for why in failed.values()), \
        "every rank fails c's requests with the failing rank's reason"
    assert "c" not in admitted and len(admitted) + len(failed) == arrived, "every other request was served"


def register_rank(rank: int, world_size: int, rendezvous: str, per_rank: list[dict], out: str) -> None:
    """Registrations where one rank's own check fails, or its check reads other weights than the others': each
    must raise on every rank, and the next good one still be agreed everywhere (the collectives stay in step).
    per_rank[rank] is the paths this rank finds under each name."""
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    spec = specs_from_config(CONFIG, max_rank=8, capacity=3)["language_model"]
    m = LoraManager({"language_model": LoraAdapterStore(spec, rank, world_size, pin=False)},
                    {"language_model": LoraDevicePool(spec, 2, rank=rank, world_size=world_size)},
                    group=dist.group.WORLD)
    mine = per_rank[rank]
    outcome = []
    for call in (lambda: m.register("a", mine["a"]), lambda: m.register_all({"a": mine["a"], "b": mine["b"]}),
                 lambda: m.register("b", mine["b"])):
        try:
            outcome.append(call().__class__.__name__)
        except ValueError as e:
            outcome.append(str(e))
    step = m.step([], [Request(1, "b"), Request(2, "a")])
    outcome.append(sorted(str(e) for e in step.failed.values()))
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, outcome)
    if rank == 0:
        torch.save(everyone, out)
    m.close()
    dist.barrier()  # no rank tears its group down while another still talks to it (a gloo abort at exit)
    dist.destroy_process_group()


def registered_on_two_ranks(tmp_path, per_rank: list[dict]) -> list:
    """Each rank's outcomes of register_rank's calls, as every rank saw them alike (each naming its own path)."""
    out = tmp_path / "out.pt"
    ctx = mp.start_processes(register_rank, args=(2, f"file://{tmp_path}/rdv", per_rank, str(out)), nprocs=2,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        assert time.monotonic() < deadline, "a rank hung"
    everyone = torch.load(out)
    if per_rank[0]["a"] == per_rank[1]["a"] or not os.path.exists(per_rank[1]["a"]):
        assert everyone[0] == everyone[1], "every rank saw the same outcomes"
    else:  # each names a's path as it read it
        mine = [[str(o).replace(per_rank[r]["a"], "<a>") for o in outcome] for r, outcome in enumerate(everyone)]
        assert mine[0] == mine[1], "every rank saw the same outcomes"
    return everyone[0]


def test_a_registration_that_fails_on_one_rank_fails_on_every_rank_without_a_hang(tmp_path):
    paths = {n: str(make_adapter(tmp_path, name=n, seed=i, config=CONFIG)[1]) for i, n in enumerate("ab")}
    single, both, good, failed = registered_on_two_ranks(tmp_path, [paths, {**paths, "a": paths["a"] +
                                                                            "-missing-on-rank-1"}])
    assert single.startswith("adapter 'a' (") and "missing-on-rank-1" in single and "no such file" in single
    assert both.startswith("1 of 2 adapters cannot be served") and "missing-on-rank-1" in both
    assert good == "Version" and failed == ["adapter 'a' is not registered"]


def test_ranks_that_read_different_weights_for_one_registration_refuse_it_on_every_rank(tmp_path):
    """Each rank's check passes, but rank 1 finds other weights at a's path (a file replaced on one node, a
    mount that differs): serving it would put two adapters under one name and one digest's prefix cache."""
    paths = {n: str(make_adapter(tmp_path, name=n, seed=i, config=CONFIG)[1]) for i, n in enumerate("ab")}
    other = str(make_adapter(tmp_path, name="other", seed=7, config=CONFIG)[1])
    single, both, good, failed = registered_on_two_ranks(tmp_path, [paths, {**paths, "a": other}])
    assert single.startswith(f"adapter 'a' ({paths['a']}): the ranks read different weights there (digests ")
    assert both.startswith("1 of 2 adapters cannot be served") and "the ranks read different weights" in both
    assert good == "Version" and failed == ["adapter 'a' is not registered"]
