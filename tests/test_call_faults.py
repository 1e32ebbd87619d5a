"""Calls and resolutions that go wrong: a rank whose resolution lands late, a resolver that hangs or raises
past Exception, an engine stepping from a pool of threads, startup configs given in another order on each
rank. Nothing hangs, no collective is crossed, every rank admits and fails the same requests at the same
steps, and the weights served are the registered file's."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist
from managers import one_node
from test_manager_calls import CONFIG, all_done, check_slots, finish, spawn
from tiny import make_adapter

from mstar.engine.resources.lora import LoraAdapterStore, LoraDevicePool, specs_from_config
from mstar.engine.resources.lora.calls import Deferred
from mstar.engine.resources.lora.check import check_adapter_file
from mstar.engine.resources.lora.manager import LoraManager, Request
from mstar.engine.resources.lora.resolvers import FolderResolver


def ranked(rank: int, world_size: int, rendezvous: str, **kw) -> LoraManager:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    spec = specs_from_config(CONFIG, max_rank=8, capacity=3)["language_model"]
    return LoraManager({"language_model": LoraAdapterStore(spec, rank, world_size, pin=False)},
                       {"language_model": LoraDevicePool(spec, 2, rank=rank, world_size=world_size)},
                       group=dist.group.WORLD, **kw)


def steps_until(m: LoraManager, queue: list[Request], done, limit: int = 2000) -> list:
    """Both ranks step (the same requests, until done() holds on every rank); each step's admitted and failed."""
    log = []
    for _ in range(limit):
        step = m.step([], queue)
        log.append((sorted(step.admitted), sorted((k, str(v)) for k, v in step.failed.items())))
        queue[:] = [r for r in queue if r.id not in step.admitted and r.id not in step.failed]
        if all_done(done()):
            return log
        time.sleep(0.005)
    raise AssertionError("the ranks never settled")


def late_rank(rank: int, world_size: int, rendezvous: str, root: str, out: str) -> None:
    folders, slow = FolderResolver(root), threading.Event()

    def resolver(name):  # rank 1 answers late, once
        if rank == 1 and name == "sql" and not slow.is_set():
            slow.set()
            time.sleep(1.5)
        return folders(name)

    m = ranked(rank, world_size, rendezvous, resolver=resolver, agree_within=0.5, unknown_for=2.5)
    first = steps_until(m, queue := [Request(1, "sql")], lambda: not queue)
    time.sleep(2.0)  # rank 1's late answer lands meanwhile: never heard
    m.step([], [])
    late_heard = "sql" in m.registry
    time.sleep(1.0)
    m.step([], [])  # the remembered failure let go, at a step every rank makes
    second = steps_until(m, queue := [Request(2, "sql")], lambda: not queue)
    finish(m, world_size, (first, late_heard, second), out)


def test_a_resolution_late_on_one_rank_fails_its_name_on_every_rank_at_one_step(tmp_path):
    make_adapter(tmp_path / "folders", name="sql", seed=1, config=CONFIG)
    (first0, heard0, second0), (first1, heard1, second1) = spawn(late_rank, tmp_path, str(tmp_path / "folders"))
    assert first0 == first1 and second0 == second1, "both ranks admitted and failed alike, at the same steps"
    failures = [f for _, failed in first0 for f in failed]
    assert len(failures) == 1 and failures[0][0] == 1
    assert failures[0][1] == ("adapter 'sql' is not registered, and its resolution landed on rank 0 but not on rank "
                              "1 within 0.5 s (agree_within): every rank resolves a name itself, and every rank's "
                              "answer must land within that of the others'")
    assert not heard0 and not heard1, "rank 1's late answer was not applied anywhere"
    assert [a for a, _ in second0 if a] == [[2]], "once let go, the name resolved anew and was admitted"


def test_a_resolver_that_hangs_or_raises_past_exception_fails_its_name_alone(tmp_path):
    make_adapter(tmp_path / "folders", name="sql", seed=1)
    folders, release, calls = FolderResolver(tmp_path / "folders"), threading.Event(), []

    def resolver(name):
        calls.append(name)
        if name.startswith("hang"):
            release.wait(30)
            return folders("sql")
        if name == "cancelled":
            raise asyncio.CancelledError()
        if name == "exit":
            raise SystemExit(3)
        return folders(name)

    base = one_node()
    m = LoraManager(base.stores, base.pools, resolver=resolver, resolver_timeout=0.5, unknown_for=60)
    hung = [Request(i, f"hang{i}") for i in range(6)]  # more than the workers: they must not hold the others
    queue = [*hung, Request(10, "cancelled"), Request(11, "exit"), Request(12, "sql")]
    failed, admitted, start = {}, [], time.monotonic()
    while queue and time.monotonic() - start < 20:
        step = m.step([], queue)
        admitted += step.admitted
        failed.update({k: str(v) for k, v in step.failed.items()})
        queue = [r for r in queue if r.id not in step.admitted and r.id not in step.failed]
        time.sleep(0.01)
    assert not queue, f"requests {[r.id for r in queue]} still wait"
    assert admitted == [12], "a good name resolved while six resolutions hung"
    for r in hung:
        assert failed[r.id] == f"adapter '{r.adapter}' is not registered, and resolver resolver did not answer " \
                               "within 0.5 s (resolver_timeout)"
    assert failed[10] == "adapter 'cancelled' is not registered, and resolver resolver could not be asked " \
                         "(CancelledError)"
    assert failed[11] == "adapter 'exit' is not registered, and resolver resolver could not be asked (SystemExit: 3)"
    release.set()  # the hung resolvers answer now: never heard, their names stay failed while remembered
    time.sleep(0.3)
    assert m.wait_for_reads(5)
    step = m.step([], [Request(20, "hang0")])
    assert "did not answer within 0.5 s" in str(step.failed[20]) and "hang0" not in m.registry
    assert calls.count("hang0") == 1
    m.close()


def pool_rank(rank: int, world_size: int, rendezvous: str, files: list[str], engine_thread: bool, out: str) -> None:
    """The engine steps from a pool of threads, and registers through the same pool (an async server's
    run_in_executor): a register may land on the thread that ran the last step."""
    m = ranked(rank, world_size, rendezvous, agree_within=30, engine_thread=engine_thread)
    spec = m.stores["language_model"].spec
    independent = LoraAdapterStore(spec, rank, world_size, pin=False)
    refs = {check_adapter_file(spec, "ref", f): independent.read("ref", f) for f in files}
    m.register_all({"a": files[0]})
    pool, outcomes, log, checked = ThreadPoolExecutor(8), [], [], 0  # room for the registers waiting on a step
    registers = []
    for i in range(120):
        if i % 3 == 0:  # the same calls on every rank, made from the pool
            registers.append(pool.submit(m.register, "a", files[(i // 3) % len(files)]))
        step = pool.submit(m.step, [], [Request(i, "a")]).result()
        checked += check_slots(m, refs, step)
        log.append((step.admitted, sorted(step.digest.items())))
    while not all_done(all(f.done() for f in registers)):
        log.append(pool.submit(m.step, [], []).result().admitted)
    for f in registers:
        try:
            f.result()
            outcomes.append("ok")
        except Deferred:
            outcomes.append("deferred")
    finish(m, world_size, (log, outcomes, checked), out)


@pytest.mark.parametrize("engine_thread", [True, False])
def test_an_engine_stepping_from_a_pool_never_crosses_collectives(tmp_path, engine_thread):
    files = [str(make_adapter(tmp_path, name=f"f{i}", seed=i, config=CONFIG)[1]) for i in range(3)]
    (log0, out0, checked0), (log1, out1, checked1) = spawn(pool_rank, tmp_path, files, engine_thread)
    assert log0 == log1, "both ranks admitted the same requests with the same digests at every step"
    assert checked0 > 20 and checked1 > 20  # how many land depends on the reads' speed, not on the calls
    assert len(out0) == len(out1) == 40 and set(out0) | set(out1) <= {"ok", "deferred"}
    if not engine_thread:
        assert out0 == out1 == ["ok"] * 40, "no thread is the engine's: every call waits for its step"


def order_rank(rank: int, world_size: int, rendezvous: str, files: dict, out: str) -> None:
    m = ranked(rank, world_size, rendezvous, agree_within=2)
    names = sorted(files) if rank == 0 else sorted(files, reverse=True)
    try:
        got = {n: v.digest for n, v in m.register_all({n: files[n] for n in names}).items()}
    except ValueError as e:
        got = str(e)
    finish(m, world_size, got, out)


def test_a_startup_config_in_another_order_on_each_rank_is_one_call(tmp_path):
    files = {n: str(make_adapter(tmp_path, name=n, seed=i, config=CONFIG)[1]) for i, n in enumerate("abc")}
    got0, got1 = spawn(order_rank, tmp_path, files)
    spec = specs_from_config(CONFIG, max_rank=8, capacity=3)["language_model"]
    assert got0 == got1 == {n: check_adapter_file(spec, n, f) for n, f in files.items()}


def landing_rank(rank: int, world_size: int, rendezvous: str, files: list[str], out: str) -> None:
    """Rank 0 steps and registers on one pool thread (so the register lands on the thread that ran the last
    step, and looks like an engine-thread call); rank 1 registers from another thread and steps."""
    m = ranked(rank, world_size, rendezvous, agree_within=30)
    spec = m.stores["language_model"].spec
    refs = {check_adapter_file(spec, "ref", f): LoraAdapterStore(spec, rank, world_size, pin=False).read("ref", f)
            for f in files}
    m.register_all({"a": files[0]})
    pool, log, outcome, checked = ThreadPoolExecutor(1), [], None, 0
    for i in range(30):
        if i == 5:
            call = pool.submit(m.register, "a", files[1]) if rank == 0 else \
                threading.Thread(target=lambda: m.register("a", files[1]), daemon=True)
            if rank == 1:
                call.start()
                time.sleep(0.2)  # queued before this rank's next step
        step = pool.submit(m.step, [], [Request(i, "a")]).result() if rank == 0 else m.step([], [Request(i, "a")])
        checked += check_slots(m, refs, step)
        log.append((step.admitted, sorted(step.digest.items())))
        time.sleep(0.01)
    if rank == 0:
        try:
            call.result()
            outcome = "ok"
        except Deferred as e:
            outcome = str(e)
    finish(m, world_size, (log, outcome, checked), out)


def test_a_register_landing_on_the_thread_that_stepped_while_another_rank_steps_is_applied_at_one_step(tmp_path):
    files = [str(make_adapter(tmp_path, name=f"f{i}", seed=i, config=CONFIG)[1]) for i in range(2)]
    (log0, outcome, checked0), (log1, _, _) = spawn(landing_rank, tmp_path, files)
    assert log0 == log1, "both ranks admitted the same requests with the same digests at every step"
    assert "while another rank stepped; it stays queued" in outcome
    spec = specs_from_config(CONFIG, max_rank=8, capacity=3)["language_model"]
    new = check_adapter_file(spec, "a", files[1])
    assert log0[-1][1] == [(29, new)] and checked0 >= 25, "the deferred register was applied on both ranks"
