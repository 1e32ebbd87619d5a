"""Registrations, pushes and unregistrations from other threads than the step's, on both ranks of a gloo group:
applied at a step every rank reaches, so no collective is ever crossed; a call made on one rank only refused
on it with a ValueError, never a hang."""

from __future__ import annotations

import json
import random
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import LoraAdapterStore, LoraDevicePool, specs_from_config
from mstar.engine.resources.lora.check import check_adapter_file, check_adapter_tensors
from mstar.engine.resources.lora.manager import LoraManager, Request

CONFIG = model_config("llama", num_attention_heads=4, num_key_value_heads=2)
NAMES = ["a", "b", "c"]
FILES = 4


def manager(rank: int, world_size: int, within: float = 30.0) -> LoraManager:
    spec = specs_from_config(CONFIG, max_rank=8, capacity=3)["language_model"]
    return LoraManager({"language_model": LoraAdapterStore(spec, rank, world_size, pin=False)},
                       {"language_model": LoraDevicePool(spec, 2, rank=rank, world_size=world_size)},
                       group=dist.group.WORLD, agree_within=within)


def start(rank: int, world_size: int, rendezvous: str) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))


def finish(m: LoraManager, world_size: int, result, out: str) -> None:
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, result)
    if dist.get_rank() == 0:
        torch.save(everyone, out)
    m.close()
    dist.barrier()  # no rank tears its group down while another still talks to it (a gloo abort at exit)
    dist.destroy_process_group()


def all_done(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def check_slots(m: LoraManager, refs: dict[bytes, object], step) -> int:
    """Every request holding a slot has its digest's weights there, as an independent read gives them."""
    pool = m.pools["language_model"]
    checked = 0
    for rid, slot in step.slot.items():
        if slot < 0:
            continue
        ref = refs[step.digest[rid]]
        for t in ref.a:
            assert torch.equal(pool.a[t][slot], ref.a[t]) and torch.equal(pool.b[t][slot], ref.b[t]), \
                f"request {rid} in slot {slot} runs other weights than digest {step.digest[rid].hex()[:16]}'s"
        assert float(pool.scaling[slot]) == pytest.approx(ref.scaling)
        checked += 1
    return checked


def race_rank(rank: int, world_size: int, rendezvous: str, files: list[str], calls: int, out: str) -> None:
    start(rank, world_size, rendezvous)
    m = manager(rank, world_size)
    spec = m.stores["language_model"].spec
    independent = LoraAdapterStore(spec, rank, world_size, pin=False)
    refs, tensors = {}, []
    for f in files:  # each file's weights and the same tensors pushed, read by a store of the test's own
        refs[check_adapter_file(spec, "ref", f)] = independent.read("ref", f)
        tensors.append((load_file(str(Path(f) / "adapter_model.safetensors")),
                        json.loads((Path(f) / "adapter_config.json").read_text())))
        refs[check_adapter_tensors(spec, "ref", *tensors[-1])] = independent.read_tensors("ref", *tensors[-1])
    m.register_all({n: files[0] for n in NAMES})
    done, errors, made = [], [], [0]

    def caller(name: str, seed: int) -> None:
        ops = random.Random(seed)  # the same calls on every rank, in the same order
        pace = random.Random(seed * 10 + rank)  # made at a different pace on each
        try:
            for _ in range(calls):
                op, i = ops.choice(["register", "register", "push", "push", "unregister"]), ops.randrange(FILES)
                if op == "register":
                    m.register(name, files[i])
                elif op == "push":
                    m.push(name, *tensors[i], copy=ops.random() < 0.5)
                else:
                    m.unregister(name)
                made[0] += 1
                time.sleep(pace.random() * 0.002)
        except BaseException as e:
            errors.append(repr(e))
        done.append(name)

    threads = [threading.Thread(target=caller, args=(n, i), daemon=True) for i, n in enumerate(NAMES)]
    for t in threads:
        t.start()
    sched, queue, running, log, checked, next_id, steps = random.Random(3), [], {}, [], 0, 0, 0
    while True:
        for _ in range(sched.randint(0, 2)):
            queue.append(Request(next_id, sched.choice([*NAMES, None])))
            next_id += 1
        step = m.step([r for r, _ in running.values()], queue)
        checked += check_slots(m, refs, step)
        log.append((sorted(step.admitted), sorted(step.failed), sorted((k, v) for k, v in step.digest.items()
                                                                         if v is not None)))
        for r in queue:
            if r.id in step.admitted:
                running[r.id] = [r, sched.randint(1, 5)]
        queue = [r for r in queue if r.id not in step.admitted and r.id not in step.failed]
        for rid in list(running):
            running[rid][1] -= 1
            if running[rid][1] == 0:
                del running[rid]
        steps += 1
        if steps % 20 == 0 and all_done(len(done) == len(NAMES)):
            break
        time.sleep(0.0005)
    for t in threads:
        t.join()
    finish(m, world_size, (log, made[0], errors, checked), out)


def spawn(fn, tmp_path, *args, world_size: int = 2, limit: float = 240):
    out = tmp_path / "out.pt"
    ctx = mp.start_processes(fn, args=(world_size, f"file://{tmp_path}/rdv", *args, str(out)), nprocs=world_size,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + limit
    while not ctx.join(timeout=1):
        assert time.monotonic() < deadline, "a rank hung"
    return torch.load(out)


def test_calls_from_threads_while_both_ranks_step_serve_every_request_its_weights(tmp_path):
    files = [str(make_adapter(tmp_path, name=f"f{i}", seed=i, config=CONFIG)[1]) for i in range(FILES)]
    everyone = spawn(race_rank, tmp_path, files, 700)
    (log, made, errors, checked), other = everyone[0], everyone[1]
    assert errors == [] and other[2] == [], f"a call raised: {errors or other[2]}"
    assert made == other[1] == 3 * 700, "every call returned, on both ranks"
    assert log == other[0], "both ranks admitted, failed and pinned the same requests in every step"
    assert checked > 1000, f"only {checked} running requests' weights were checked"
    digests = {d for _, _, pins in log for _, d in pins}
    assert len(digests) >= FILES, "requests ran every file's weights (as files or pushed) over the run"


def one_rank_rank(rank: int, world_size: int, rendezvous: str, paths: dict, out: str) -> None:
    start(rank, world_size, rendezvous)
    m = manager(rank, world_size, within=1.0)
    result = {}

    def call(what, fn) -> None:
        try:
            fn()
            result[what] = "ok"
        except ValueError as e:
            result[what] = str(e)

    threads = []
    if rank == 0:
        threads.append(threading.Thread(target=call, args=("alone", lambda: m.register("x", paths["x"]))))
    threads.append(threading.Thread(target=call, args=("both", lambda: m.register("y", paths["y"]))))
    for t in threads:
        t.start()
    admitted_at, step_count = None, 0
    # the ranks' loops end together (a collective of the test's own), so they make the same steps
    while not all_done(step_count >= 400 or (admitted_at is not None and not any(t.is_alive() for t in threads))):
        # y is queued once registered: the registry changes at a step's start alike on every rank
        step = m.step([], [Request(1, "y")] if admitted_at is None and "y" in m.registry else [])
        if step.admitted:
            admitted_at = step_count
        step_count += 1
        time.sleep(0.01)
    for t in threads:
        t.join()
    # a call on the engine thread of one rank while the other steps: deferred there (it stays queued; the other
    # rank never makes it, so it is applied nowhere), and the other rank's step waits for this rank's next one
    if rank == 0:
        try:
            m.register("z", paths["x"])
            result["crossed"] = "ok"
        except ValueError as e:
            result["crossed"] = str(e)
    step = m.step([], [Request(2, "y"), Request(3, "z")])
    result["after"] = (step.admitted, {k: str(v) for k, v in step.failed.items()})
    finish(m, world_size, (result, admitted_at), out)


def test_a_call_made_on_one_rank_only_is_refused_there_and_never_hangs(tmp_path):
    paths = {n: str(make_adapter(tmp_path, name=n, seed=i, config=CONFIG)[1]) for i, n in enumerate("xy")}
    everyone = spawn(one_rank_rank, tmp_path, paths, limit=120)
    (r0, at0), (r1, at1) = everyone
    assert "adapter 'x': register was called on rank 0 but not on rank 1 within 1 s" in r0["alone"]
    assert "alone" not in r1
    assert r0["both"] == r1["both"] == "ok" and at0 is not None and at0 == at1, \
        "a call made on both ranks' threads is applied, and its request admitted, at the same step on each"
    assert "while another rank stepped; it stays queued" in r0["crossed"] and "crossed" not in r1
    assert r0["after"] == r1["after"] == ([2], {3: "adapter 'z' is not registered"}), \
        "the refused call was applied nowhere, and the group still steps alike"
