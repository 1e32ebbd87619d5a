"""A manager closed, or its group broken, with calls waiting: a round in flight finishes first (a peer that is
slow, not gone, is waited for), its callers are told what it did, queued calls are refused, a caller whose round
failed is not left waiting, and nothing waits on resolutions that will never start."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from managers import one_node
from test_call_lifecycle import outcome, ranked, wait_until
from test_manager_calls import CONFIG, finish, spawn
from tiny import make_adapter

from mstar.engine.resources.lora import LoraAdapterStore, LoraDevicePool, specs_from_config
from mstar.engine.resources.lora.manager import LoraManager, Request


def closing_rank(rank: int, world_size: int, rendezvous: str, path: str, out: str) -> None:
    m = ranked(rank, world_size, rendezvous)
    results = []
    t = threading.Thread(target=lambda: results.append(outcome(lambda: m.register("a", path))))
    t.start()
    time.sleep(0.5)  # queued, waiting for a step that never comes
    m.close()
    t.join(20)
    results.append(outcome(lambda: m.register("b", path)))
    alive = t.is_alive()
    dist.barrier()
    dist.destroy_process_group()
    import torch

    torch.save((results, alive), out)


def test_closing_a_manager_refuses_the_calls_waiting_on_it(tmp_path):
    _, path = make_adapter(tmp_path, name="a", seed=1, config=CONFIG)
    results, alive = spawn(closing_rank, tmp_path, str(path), world_size=1, limit=60)
    assert not alive, "a caller still waits on a closed manager"
    assert results == ["adapter 'a': register was not applied: the manager was closed",
                       "adapter 'b': register was not applied: the manager was closed"]


def close_racing_rank(rank: int, world_size: int, rendezvous: str, path: str, out: str) -> None:
    """Rank 0 closes its manager from another thread while its step's round (which took a call in) waits for
    rank 1."""
    m = ranked(rank, world_size, rendezvous, agree_within=5.0)
    m.step([], [])
    res = {}
    caller = threading.Thread(target=lambda: res.__setitem__("caller", outcome(lambda: m.register("x", path))))
    caller.start()  # waits for the next step
    wait_until(lambda: len(m._calls) == 1)
    if rank == 0:
        stepping = threading.Thread(target=lambda: res.__setitem__("step", outcome(lambda: m.step([], []))))
        stepping.start()  # takes the call in, then waits in its round for rank 1
        time.sleep(0.5)
        m.close()
        stepping.join(15)
    else:
        time.sleep(1.5)
        res["step"] = outcome(lambda: m.step([], []))
    caller.join(15)
    res["registered"] = "x" in m.registry
    finish(m, world_size, res, out)


def test_closing_a_manager_while_its_step_is_in_a_round_tells_the_caller_what_the_round_did(tmp_path):
    _, path = make_adapter(tmp_path, name="x", seed=1, config=CONFIG)
    r0, r1 = spawn(close_racing_rank, tmp_path, str(path), limit=90)
    assert r0 == r1 == {"caller": "ok", "step": "ok", "registered": True}, \
        "the round in flight finished before the close: applied on both ranks, and its caller told so"


def slow_peer_rank(rank: int, world_size: int, rendezvous: str, path: str, out: str) -> None:
    """Rank 0 closes while its step waits for rank 1, which steps 3 s later (slow, not gone)."""
    m = ranked(rank, world_size, rendezvous, agree_within=1.0)
    m.register("a", path)
    for _ in range(50):  # a in on both ranks: the next step holds it without a read
        if m.step([], [Request(0, "a")]).admitted:
            break
        m.wait_for_reads(2)
    res = {}
    if rank == 1:
        time.sleep(2.5)
    caller = threading.Thread(target=lambda: res.__setitem__("caller", outcome(lambda: m.register("x", path))))
    caller.start()
    wait_until(lambda: len(m._calls) == 1)
    if rank == 0:
        stepping = threading.Thread(target=lambda: res.__setitem__("step", outcome(
            lambda: m.step([], [Request(1, "a")]))))
        stepping.start()
        time.sleep(0.3)
        m.close()
        stepping.join(30)
    else:
        time.sleep(0.5)
        start = time.monotonic()
        res["step"] = outcome(lambda: m.step([], [Request(1, "a")]))
        res["slow step"] = time.monotonic() - start > 10
    caller.join(15)
    res["registered"] = "x" in m.registry
    finish(m, world_size, res, out)


def test_closing_while_a_slow_peer_holds_the_round_waits_for_it_and_tells_the_truth(tmp_path):
    _, path = make_adapter(tmp_path, name="a", seed=1, config=CONFIG)
    r0, r1 = spawn(slow_peer_rank, tmp_path, str(path), limit=120)
    assert r0 == {"caller": "ok", "step": "ok", "registered": True}, r0
    assert r1 == {"caller": "ok", "step": "ok", "slow step": False, "registered": True}, \
        "rank 0 made every collective of its step: rank 1's was not left waiting"


def gone_peer_rank(rank: int, world_size: int, rendezvous: str, path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=5))

    spec = specs_from_config(CONFIG, max_rank=8, capacity=3)["language_model"]
    m = LoraManager({"language_model": LoraAdapterStore(spec, rank, world_size, pin=False)},
                    {"language_model": LoraDevicePool(spec, 2, rank=rank, world_size=world_size)},
                    group=dist.group.WORLD, agree_within=1.0)
    m.step([], [])
    if rank == 1:
        time.sleep(1.0)
        os._exit(0)  # the peer goes away
    res = {}
    caller = threading.Thread(target=lambda: res.__setitem__("caller", outcome(lambda: m.register("x", path))),
                              daemon=True)
    caller.start()
    wait_until(lambda: len(m._calls) == 1)
    try:
        m.step([], [])
        res["step"] = "ok"
    except RuntimeError:  # the group's own timeout: the collective failed
        res["step"] = "RuntimeError"
    stop = threading.Event()

    def retrying():  # an engine that catches a failed step and steps again at once, into the broken group
        while not stop.wait(0.01):
            with contextlib.suppress(RuntimeError, ValueError):  # the group's failure, then its refusal
                m.step([], [])

    engine = threading.Thread(target=retrying, daemon=True)
    engine.start()
    caller.join(4)
    res["waiting"] = caller.is_alive()
    res["later"] = outcome(lambda: m.register("y", path))
    stop.set()
    engine.join(10)
    torch.save(res, out)
    os._exit(0)  # the group is broken: no teardown


def test_a_caller_whose_round_failed_with_its_group_is_not_left_waiting(tmp_path):
    _, path = make_adapter(tmp_path, name="a", seed=1, config=CONFIG)
    res = spawn(gone_peer_rank, tmp_path, str(path), limit=90)
    assert res["step"] == "RuntimeError" and not res["waiting"], res
    for name in ("x", "y"):  # the call in the failed round, and one made after it
        key = "caller" if name == "x" else "later"
        assert res[key].startswith(f"adapter {name!r}: register was not applied: a round of this manager's "
                                   "process group ended part way on rank 0 (RuntimeError"), res


def test_close_is_not_starved_by_an_engine_stepping_back_to_back():
    m = one_node()
    stop, refusals = threading.Event(), []

    def loop():  # an engine that steps with no pause, and steps on whatever a step raises
        while not stop.is_set():
            try:
                m.step([], [])
            except ValueError as e:
                refusals.append(str(e))

    engine = threading.Thread(target=loop, daemon=True)
    engine.start()
    time.sleep(0.2)
    closer = threading.Thread(target=m.close, daemon=True)
    closer.start()
    closer.join(10)
    closed = not closer.is_alive()
    stop.set()
    engine.join(10)
    assert closed, "close() waited on an engine thread that took the lock back step after step"
    assert refusals and refusals[-1].startswith("step: the manager was closed"), refusals[-1:]


def test_a_request_after_close_is_never_left_waiting_on_a_resolution(tmp_path):
    _, path = make_adapter(tmp_path, name="a", seed=1)
    base = one_node()
    m = LoraManager(base.stores, base.pools, resolver=lambda name: path)
    m.close()
    for call in (lambda: m.step([], [Request(0, "late")]), lambda: m.prefetch([Request(0, "late")])):
        try:
            call()
            raise AssertionError("a closed manager stepped")
        except ValueError as e:
            assert "the manager was closed" in str(e), e
    assert m.wait_for_reads(1) and m._resolution.pending() == [], "a resolution started after close"


def test_close_from_a_resolver_thread_returns(tmp_path):
    _, path = make_adapter(tmp_path, name="a", seed=1)
    base, res = one_node(), {}

    def resolver(name):  # a resolver that shuts the manager down (the store it serves from is gone)
        try:
            m.close()
            res["close"] = "ok"
        except BaseException as e:  # what close raised, to assert on
            res["close"] = repr(e)
        return path

    m = LoraManager(base.stores, base.pools, resolver=resolver)
    m.step([], [Request(0, "n")])
    wait_until(lambda: "close" in res)
    assert res["close"] == "ok", res
