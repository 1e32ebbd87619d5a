"""A round that ends part way: an interrupt (a KeyboardInterrupt as a SIGINT raises it) while a round's calls
are applied, or after one rank's collectives returned; a collective failing under an engine-thread call; close
from a read worker, and from every rank while their engine threads are in calls' rounds. Every caller told,
nothing hangs, no collective crosses another: a rank left out of step refuses its steps, saying why."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from managers import one_node
from test_call_lifecycle import outcome, ranked, wait_until
from test_manager_calls import CONFIG, spawn
from tiny import make_adapter

from mstar.engine.resources.lora import LoraAdapterStore, LoraDevicePool, specs_from_config
from mstar.engine.resources.lora.manager import LoraManager, Request

BROKEN = "a round of this manager's process group ended part way on rank"


def interrupt_first_register(m: LoraManager) -> None:
    """m's first registration applied raises KeyboardInterrupt (a SIGINT landing in the applying thread)."""
    real, fired = m._register, []

    def interrupted(v):
        if not fired:
            fired.append(1)
            raise KeyboardInterrupt
        return real(v)

    m._register = interrupted


def queued_from_threads(m: LoraManager, calls: dict[str, str]) -> tuple[dict, list[threading.Thread]]:
    res: dict = {}
    threads = [threading.Thread(target=lambda n=n, p=p: res.__setitem__(n, outcome(lambda: m.register(n, p))),
                                daemon=True) for n, p in calls.items()]
    for i, t in enumerate(threads):
        t.start()
        wait_until(lambda i=i: len(m._calls) == i + 1)
    return res, threads


def ranks(fn, tmp_path, *args, world_size: int = 2, limit: float = 120) -> list:
    """Each rank's result, where each rank saves its own (as spawn's ranks save one)."""
    out = tmp_path / "out.pt"
    ctx = mp.start_processes(fn, args=(world_size, f"file://{tmp_path}/rdv", *args, str(out)), nprocs=world_size,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + limit
    while not ctx.join(timeout=1):
        assert time.monotonic() < deadline, "a rank hung"
    return [torch.load(f"{out}{r}") for r in range(world_size)]


def test_an_interrupt_while_calls_are_applied_tells_every_caller(tmp_path):
    pa, pb = (make_adapter(tmp_path, name=n, seed=i)[1] for i, n in enumerate("ab"))
    m = one_node()
    m.step([], [])
    interrupt_first_register(m)
    with m._rounds:  # both queued, then applied by this thread's step (their callers, which would apply them
        res, threads = queued_from_threads(m, {"a": str(pa), "b": str(pb)})  # themselves, wait on the lock)
        try:
            m.step([], [])
            raise AssertionError("the interrupt was swallowed")
        except KeyboardInterrupt:
            pass
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "a caller waits on a call taken off the queue"
    for n in "ab":
        assert res[n].startswith(f"adapter {n!r}: register was interrupted as it was applied (KeyboardInterrupt)")
    m.step([], [])  # without a group nothing is out of step: the manager serves on
    assert m.register("b", pb).name == "b"
    m.close()


def interrupted_rank(rank: int, world_size: int, rendezvous: str, pa: str, pb: str, out: str) -> None:
    m = ranked(rank, world_size, rendezvous, agree_within=1.0)
    m.step([], [])
    interrupt_first_register(m)
    res, threads = queued_from_threads(m, {"a": pa, "b": pb})
    res["step"] = "ok"
    try:
        m.step([], [])
    except KeyboardInterrupt:
        res["step"] = "KeyboardInterrupt"
    for t in threads:
        t.join(10)
    res["waiting"] = any(t.is_alive() for t in threads)
    res["next step"] = outcome(lambda: m.step([], [Request(0, "a")]))
    res["later"] = outcome(lambda: m.register("b", pb))
    m.close()
    torch.save(res, out)
    dist.destroy_process_group()


def test_an_interrupt_in_a_round_with_a_group_refuses_its_calls_and_every_later_step(tmp_path):
    pa, pb = (str(make_adapter(tmp_path, name=n, seed=i, config=CONFIG)[1]) for i, n in enumerate("ab"))
    res = spawn(interrupted_rank, tmp_path, pa, pb, world_size=1, limit=90)
    assert res["step"] == "KeyboardInterrupt" and not res["waiting"], res
    for key, name in (("a", "a"), ("b", "b"), ("later", "b")):
        assert res[key].startswith(f"adapter {name!r}: register was not applied: {BROKEN} 0 (KeyboardInterrupt)"), res
    assert res["next step"].startswith(f"step: {BROKEN} 0 (KeyboardInterrupt)"), res


def one_sided_rank(rank: int, world_size: int, rendezvous: str, path: str, out: str) -> None:
    """Rank 0 is interrupted right after its round's all_gather returned (rank 1 applies the call); both
    engines catch what their step raises and step on."""
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=6))
    spec = specs_from_config(CONFIG, max_rank=8, capacity=3)["language_model"]
    m = LoraManager({"language_model": LoraAdapterStore(spec, rank, world_size, pin=False)},
                    {"language_model": LoraDevicePool(spec, 2, rank=rank, world_size=world_size)},
                    group=dist.group.WORLD, agree_within=2.0)
    m.step([], [])
    if rank == 0:
        real = m._calls._match

        def interrupted(*a, **k):
            m._calls._match = real
            raise KeyboardInterrupt

        m._calls._match = interrupted
    res, (caller,) = queued_from_threads(m, {"x": path})
    try:
        m.step([], [])
        res["step"] = "ok"
    except BaseException as e:
        res["step"] = type(e).__name__
    caller.join(5)
    steps = []
    for i in range(3):  # both step on, on a request for x
        try:
            m.step([], [Request(i, "x")])
            steps.append("ok")
        except BaseException as e:
            steps.append(f"{type(e).__name__}: {e}")
        m.wait_for_reads(1)
    res["steps"] = steps
    torch.save(res, f"{out}{rank}")
    os._exit(0)  # the group is out of step: no teardown


def test_a_round_interrupted_on_one_rank_only_never_crosses_collectives(tmp_path):
    _, path = make_adapter(tmp_path, name="x", seed=1, config=CONFIG)
    r0, r1 = ranks(one_sided_rank, tmp_path, str(path))  # a rank aborted by crossed collectives fails here
    assert r0["step"] == "KeyboardInterrupt", r0
    assert r0["x"].startswith(f"adapter 'x': register was not applied: {BROKEN} 0"), r0
    assert all(s.startswith(f"ValueError: step: {BROKEN} 0 (KeyboardInterrupt)") for s in r0["steps"]), r0
    assert r1["step"] == "ok" and r1["x"] == "ok", r1  # its round completed there: applied, and told so
    assert r1["steps"][0].startswith("RuntimeError") and all(
        s.startswith(f"ValueError: step: {BROKEN} 1 (RuntimeError") for s in r1["steps"][1:]), r1


def interrupted_hold_rank(rank: int, world_size: int, rendezvous: str, path: str, out: str) -> None:
    """Rank 0's step is interrupted before its states' collective (in its holds), rank 1's is in that
    collective; both engines catch what their step raises and step on."""
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=6))
    spec = specs_from_config(CONFIG, max_rank=8, capacity=3)["language_model"]
    m = LoraManager({"language_model": LoraAdapterStore(spec, rank, world_size, pin=False)},
                    {"language_model": LoraDevicePool(spec, 2, rank=rank, world_size=world_size)},
                    group=dist.group.WORLD, agree_within=2.0)
    m.register("a", path)  # on both engine threads: agreed at once
    if rank == 0:
        real = m._hold

        def interrupted(*a, **k):
            m._hold = real
            raise KeyboardInterrupt

        m._hold = interrupted
    steps = []
    for i in range(4):
        try:
            m.step([], [Request(i, "a")])
            steps.append("ok")
        except BaseException as e:
            steps.append(f"{type(e).__name__}: {e}")
    torch.save(steps, f"{out}{rank}")
    os._exit(0)  # the group is out of step: no teardown


def test_a_step_interrupted_outside_its_calls_makes_no_collective_after_it(tmp_path):
    _, path = make_adapter(tmp_path, name="a", seed=1, config=CONFIG)
    r0, r1 = ranks(interrupted_hold_rank, tmp_path, str(path))  # crossed collectives abort a rank: fails here
    assert r0[0] == "KeyboardInterrupt: " and all(s.startswith(f"ValueError: step: {BROKEN} 0 (KeyboardInterrupt)")
                                                  for s in r0[1:]), r0
    assert r1[0].startswith("RuntimeError") and all(s.startswith(f"ValueError: step: {BROKEN} 1 (RuntimeError")
                                                    for s in r1[1:]), r1


def gone_under_call_rank(rank: int, world_size: int, rendezvous: str, path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=3))
    spec = specs_from_config(CONFIG, max_rank=8, capacity=3)["language_model"]
    m = LoraManager({"language_model": LoraAdapterStore(spec, rank, world_size, pin=False)},
                    {"language_model": LoraDevicePool(spec, 2, rank=rank, world_size=world_size)},
                    group=dist.group.WORLD, agree_within=1.0)
    m.step([], [])
    if rank == 1:
        time.sleep(0.5)
        os._exit(0)  # the peer goes away
    time.sleep(1.0)
    try:
        m.register("x", path)  # on the engine thread: agreed at once, by a round of its own
        res = "ok"
    except ValueError as e:
        res = f"ValueError: {e}"
    except BaseException as e:
        res = f"{type(e).__name__}: {e}"
    torch.save(res, out)
    os._exit(0)


def test_an_engine_thread_call_whose_round_failed_is_refused_naming_its_adapter(tmp_path):
    _, path = make_adapter(tmp_path, name="x", seed=1, config=CONFIG)
    res = spawn(gone_under_call_rank, tmp_path, str(path), limit=60)
    assert res.startswith(f"ValueError: adapter 'x': register was not applied: {BROKEN} 0 (RuntimeError"), res


def test_close_from_a_read_worker_returns(tmp_path):
    _, path = make_adapter(tmp_path, name="a", seed=1)
    res, box = {}, {}

    class ClosingStore(LoraAdapterStore):
        def read(self, *a, **k):  # the store it serves from is gone: the manager shut down from the read
            try:
                box["m"].close()
                res["close"] = "ok"
            except BaseException as e:  # what close raised, to assert on
                res["close"] = repr(e)
            return super().read(*a, **k)

    m = box["m"] = one_node(store_class=ClosingStore)
    m.register("a", path)
    m.step([], [Request(0, "a")])
    wait_until(lambda: "close" in res)
    assert res["close"] == "ok", res


def closing_in_calls_rank(rank: int, world_size: int, rendezvous: str, pa: str, pb: str, out: str) -> None:
    """Each rank makes a call of its own on its engine thread (so each loops in rounds until agree_within),
    and closes from another thread meanwhile."""
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=30))
    spec = specs_from_config(CONFIG, max_rank=8, capacity=3)["language_model"]
    m = LoraManager({"language_model": LoraAdapterStore(spec, rank, world_size, pin=False)},
                    {"language_model": LoraDevicePool(spec, 2, rank=rank, world_size=world_size)},
                    group=dist.group.WORLD, agree_within=3.0)
    m.step([], [])
    dist.barrier()
    res, start = {}, time.monotonic()

    def closer():
        time.sleep(1.0)
        m.close()
        res["closed after"] = time.monotonic() - start

    c = threading.Thread(target=closer, daemon=True)
    c.start()
    res["call"] = outcome(lambda: m.register("ab"[rank], [pa, pb][rank]))
    c.join(60)
    torch.save(res, f"{out}{rank}")
    dist.barrier()  # both ranks alive until both are done
    dist.destroy_process_group()


def test_closing_every_rank_while_their_engine_threads_are_in_calls_waits_for_the_calls_alone(tmp_path):
    pa, pb = (str(make_adapter(tmp_path, name=n, seed=i, config=CONFIG)[1]) for i, n in enumerate("ab"))
    for r, (name, res) in enumerate(zip("ab", ranks(closing_in_calls_rank, tmp_path, pa, pb), strict=True)):
        assert res["call"].startswith(f"adapter {name!r}: register was called on rank {r} but not on rank"), res
        assert res["closed after"] < 20, "a close held for the group's timeout by a round its peer never made"
