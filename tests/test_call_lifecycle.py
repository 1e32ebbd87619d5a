"""Calls and resolutions over a manager's life: an engine whose stepping thread changes, a registration made
while its name is being resolved, a resolver past its time while the engine waits for reads, calls applied
from two threads at once, unregistering what a resolution left, reloads queued in another order on each rank,
and a listing racing unregistrations (closing: test_call_shutdown.py). Nothing hangs, and what is
served is what was registered."""

from __future__ import annotations

import dataclasses
import shutil
import sys
import threading
import time

from managers import one_node, settle
from test_call_faults import ranked
from test_manager_calls import CONFIG, finish, spawn
from tiny import make_adapter

from mstar.engine.resources.lora import specs_from_config
from mstar.engine.resources.lora.calls import Calls
from mstar.engine.resources.lora.check import check_adapter_file
from mstar.engine.resources.lora.manager import LoraManager, Request
from mstar.engine.resources.lora.resolution import Resolution
from mstar.engine.resources.lora.resolvers import FolderResolver


def outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except ValueError as e:
        return str(e)


def moving_rank(rank: int, world_size: int, rendezvous: str, files: list[str], out: str) -> None:
    """The engine warms up on the main thread, then steps from a loop thread, which registers too."""
    m = ranked(rank, world_size, rendezvous, agree_within=1.0)
    m.register("a", files[0])
    for i in range(3):  # the warm-up, on the thread that built it
        m.step([], [Request(i, "a")] if i == 0 else [])
    result = {}

    def loop() -> None:
        result["before"] = outcome(lambda: m.register("c", files[1]))  # before this thread's first step
        m.step([], [])
        result["after"] = outcome(lambda: m.register("b", files[1]))  # the engine thread now: agreed at once
        steps = [m.step([], [Request(10, "b"), Request(11, "c")]) for _ in range(40)]
        result["admitted"] = [(sorted(s.admitted), sorted((k, str(v)) for k, v in s.failed.items())) for s in steps]
        result["digest"] = next(s.digest[10] for s in steps if 10 in s.admitted)

    t = threading.Thread(target=loop)
    t.start()
    t.join()
    finish(m, world_size, result, out)


def test_an_engine_that_warms_up_on_one_thread_and_loops_on_another_registers_from_its_loop(tmp_path):
    files = [str(make_adapter(tmp_path, name=f"f{i}", seed=i, config=CONFIG)[1]) for i in range(2)]
    r0, r1 = spawn(moving_rank, tmp_path, files, limit=120)
    assert r1.pop("before") == r0["before"].replace("rank 0", "rank 1")
    assert {**r0, "before": None} == {**r1, "before": None}, "both ranks admitted alike at every step"
    assert r0["before"].startswith("adapter 'c': register was queued on rank 0 and no step took it in within 1 s")
    assert r0["after"] == "ok"
    spec = specs_from_config(CONFIG, max_rank=8, capacity=3)["language_model"]
    assert r0["digest"] == check_adapter_file(spec, "b", files[1])
    assert r0["admitted"][0][1] == [(11, "adapter 'c' is not registered")], "the refused call applied nowhere"
    assert any(10 in admitted for admitted, _ in r0["admitted"])


def test_a_registration_made_while_its_name_is_resolved_stands_and_fails_as_registered(tmp_path):
    make_adapter(tmp_path / "folders", name="x", seed=1)
    folders, release = FolderResolver(tmp_path / "folders"), threading.Event()

    def resolver(name):
        release.wait(30)
        return folders(name)

    base = one_node()
    m = LoraManager(base.stores, base.pools, resolver=resolver)
    assert not m.step([], [Request(1, "x")]).admitted  # its resolution under way
    mine = tmp_path / "mine"
    shutil.copytree(tmp_path / "folders" / "x", mine)
    registered = m.register("x", mine)
    (mine / "adapter_model.safetensors").write_bytes(b"")  # the registered file's read fails
    release.set()
    assert m.wait_for_reads(10)
    step = settle(m, [], [Request(2, "x")])
    assert "x" in m.registry and 2 in step.failed and str(step.failed[2]).startswith(f"adapter 'x' ({mine}")
    page = m.adapters()
    assert [(a.name, a.version, a.where) for a in page.adapters] == [("x", registered.key, "failed")], \
        "the user's registration stands, failed, rather than being given back as a resolution's would be"
    m.close()


def test_wait_for_reads_returns_once_a_hung_resolver_is_past_its_time(tmp_path):
    release = threading.Event()
    base = one_node()
    m = LoraManager(base.stores, base.pools, resolver=lambda name: release.wait(60), resolver_timeout=0.3)
    m.prefetch([Request(1, "hung")])
    returned = []
    t = threading.Thread(target=lambda: returned.append(m.wait_for_reads()), daemon=True)
    start = time.monotonic()
    t.start()
    t.join(20)
    assert returned == [True] and time.monotonic() - start < 10, "wait_for_reads hung on a resolver past its time"
    step = m.step([], [Request(1, "hung")])
    assert str(step.failed[1]) == "adapter 'hung' is not registered, and resolver <lambda> did not answer " \
                                  "within 0.3 s (resolver_timeout)", "failed at the first step after the wait"
    release.set()
    m.close()


def test_unknown_names_expiring_on_two_threads_at_once_are_each_forgotten_once():
    calls = Calls(None, 30.0)
    resolution = Resolution(lambda name: None, lambda name, source: "unused", calls, unknown_for=0.0)
    errors: list[BaseException] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for round_ in range(300):
            names = [f"n{round_}-{i}" for i in range(30)]
            for n in names:
                resolution.applied(n, ValueError(f"adapter {n!r} is not registered"))
            go = threading.Barrier(2)

            def expire(go: threading.Barrier = go) -> None:
                go.wait()
                try:
                    resolution.expire()
                except BaseException as e:
                    errors.append(e)

            threads = [threading.Thread(target=expire) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            forgets = [c.names[0] for c, _ in calls.agree()]
            assert sorted(forgets) == sorted(names), "each unknown name forgotten once"
            for n in forgets:
                resolution.forget(n)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]


def test_calls_and_steps_from_two_threads_without_a_group_serve_the_registered_weights(tmp_path):
    _, good = make_adapter(tmp_path / "folders", name="good", seed=2)
    base = one_node()
    m = LoraManager(base.stores, base.pools, resolver=FolderResolver(tmp_path / "folders"), unknown_for=0.0)
    spec = m.stores["language_model"].spec
    digest, errors, stop = check_adapter_file(spec, "good", good), [], threading.Event()

    def churn() -> None:
        try:
            for i in range(3000):  # calls applied on this thread, as the steps are on the other
                m.register("g", good) if i % 100 == 0 else m.unregister("g")
        except BaseException as e:
            errors.append(e)
        stop.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        t = threading.Thread(target=churn)
        t.start()
        steps = 0
        while not stop.is_set():  # unknown names fail and are let go at once: expiring on both threads
            step = m.step([], [*(Request((steps, i), f"nobody{i}") for i in range(20)), Request(-1, "good")])
            if -1 in step.admitted:
                assert step.digest[-1] == digest
                m.step([Request(-1, "good")], [])
                m.step([], [])
            steps += 1
        t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert steps > 20
    m.close()


def test_unregistering_a_resolved_name_gives_back_what_its_resolution_left(tmp_path):
    make_adapter(tmp_path / "folders", name="sql", seed=1)
    base = one_node()
    m = LoraManager(base.stores, base.pools, resolver=FolderResolver(tmp_path / "folders"))
    for _ in range(50):
        if m.step([], [Request(1, "sql")]).admitted:
            break
        m.wait_for_reads(5)
    assert "sql" in m.registry and m._resolution.resolved == {"sql"}
    m.unregister("sql")
    assert "sql" not in m.registry and not m._resolution.resolved, "the resolution's record of it kept"
    m.close()


def crossed_rank(rank: int, world_size: int, rendezvous: str, files: list[str], out: str) -> None:
    """Two reloads of one name, from two threads, queued in one order on rank 0 and the other on rank 1."""
    m = ranked(rank, world_size, rendezvous, agree_within=5.0)
    results = {}
    order = files if rank == 0 else files[::-1]
    threads = []
    for f in order:
        t = threading.Thread(target=lambda f=f: results.__setitem__(f, outcome(lambda: m.register("a", f))))
        t.start()
        threads.append(t)
        time.sleep(0.3)  # queued in this order
    step = m.step([], [])
    for t in threads:
        t.join(30)
    for _ in range(200):
        step = m.step([], [Request(1, "a")])
        if step.admitted:
            break
        time.sleep(0.01)
    finish(m, world_size, (results, m.registry.resolve("a").digest, step.digest.get(1)), out)


def test_two_reloads_queued_in_another_order_on_each_rank_are_both_applied_in_one_order(tmp_path):
    files = [str(make_adapter(tmp_path, name=f"f{i}", seed=i, config=CONFIG)[1]) for i in range(2)]
    (res0, current0, admitted0), (res1, current1, admitted1) = spawn(crossed_rank, tmp_path, files, limit=120)
    assert res0 == res1 == {f: "ok" for f in files}, "each reload paired with the same file's on the other rank"
    spec = specs_from_config(CONFIG, max_rank=8, capacity=3)["language_model"]
    assert current0 == current1 == check_adapter_file(spec, "a", files[1]), "applied in rank 0's order"
    assert admitted0 == admitted1 == current0


def test_a_listing_racing_unregistrations_lists_every_name_registered_throughout(tmp_path):
    _, path = make_adapter(tmp_path, name="ad", seed=1)
    m = one_node()
    v = m.check_all({"ad": path})["ad"]
    stable = [f"s{i:05d}" for i in range(20000)]  # a sort of them takes long enough for a change to land
    m.register_all({n: dataclasses.replace(v, name=n) for n in stable})
    coming = {f"s{i:05d}x": dataclasses.replace(v, name=f"s{i:05d}x") for i in range(0, 20000, 40)}
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():  # names that sort among the stable ones, coming and going
            m.register_all(coming)
            for n in coming:
                m.unregister(n)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        for _ in range(6):
            names, after = [], None
            while True:
                page = m.adapters(after, limit=300)
                names += [a.name for a in page.adapters]
                if page.next is None:
                    break
                after = page.next
            missing = set(stable) - set(names)
            assert not missing, f"a listing ended early, missing {len(missing)} names from {min(missing)}"
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)


def wait_until(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "never came"
        time.sleep(0.01)


def reordered_rank(rank: int, world_size: int, rendezvous: str, files: list[str], out: str) -> None:
    """Two reloads of one name from two threads, in one order on rank 0 and the other on rank 1, a step
    between them."""
    m = ranked(rank, world_size, rendezvous, agree_within=3.0)
    m.step([], [])
    res = {}
    first, second = files if rank == 0 else files[::-1]
    threads = [threading.Thread(target=lambda: res.__setitem__("first", outcome(lambda: m.register("x", first))))]
    threads[0].start()
    wait_until(lambda: len(m._calls) == 1)
    m.step([], [])  # each rank with one reload queued, of other files
    threads.append(threading.Thread(target=lambda: res.__setitem__("second", outcome(lambda: m.register("x", second)))))
    threads[1].start()
    wait_until(lambda: len(m._calls) == 2)  # both queued on this rank before any step matches them
    for _ in range(3):
        m.step([], [])
    for t in threads:
        t.join(10)
    finish(m, world_size, (res, m.registry.resolve("x").digest), out)


def test_two_reloads_in_another_order_on_each_rank_with_a_step_between_are_both_applied(tmp_path):
    files = [str(make_adapter(tmp_path, name=f"f{i}", seed=i, config=CONFIG)[1]) for i in range(2)]
    (res0, digest0), (res1, digest1) = spawn(reordered_rank, tmp_path, files, limit=90)
    assert res0 == res1 == {"first": "ok", "second": "ok"}
    spec = specs_from_config(CONFIG, max_rank=8, capacity=3)["language_model"]
    assert digest0 == digest1 == check_adapter_file(spec, "x", files[1]), "rank 0's later reload is current"


def late_loop_rank(rank: int, world_size: int, rendezvous: str, files: list[str], out: str) -> None:
    """The loop thread registers before its first step while the warm-up's last step runs on main: on rank 1
    that step takes the call in (unmatched), on rank 0 the call comes after it."""
    m = ranked(rank, world_size, rendezvous, agree_within=2.0)
    m.register("a", files[0])
    m.step([], [])
    res = {}

    def loop() -> None:
        if rank == 0:
            time.sleep(0.6)
        res["register"] = outcome(lambda: m.register("c", files[1]))
        res["step"] = outcome(lambda: m.step([], []))

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    if rank == 1:
        wait_until(lambda: len(m._calls) == 1)
    m.step([], [])
    t.join(30)
    res["blocked"] = t.is_alive()
    res["registered"] = "c" in m.registry
    finish(m, world_size, res, out)


def test_a_call_one_rank_took_in_and_another_did_not_is_refused_on_both_never_a_hang(tmp_path):
    files = [str(make_adapter(tmp_path, name=f"f{i}", seed=i, config=CONFIG)[1]) for i in range(2)]
    r0, r1 = spawn(late_loop_rank, tmp_path, files, limit=90)
    for r, res in enumerate((r0, r1)):
        assert not res["blocked"] and res["step"] == "ok" and not res["registered"], res
        assert res["register"].startswith(f"adapter 'c': register was queued on rank {r} and no step took it in"), res


def same_round_rank(rank: int, world_size: int, rendezvous: str, root: str, mine: str, out: str) -> None:
    """A user's registration of x and x's resolution, both queued before one step, on both ranks."""
    folders, release = FolderResolver(root), threading.Event()

    def resolver(name):
        release.wait(30)
        return folders(name)

    m = ranked(rank, world_size, rendezvous, resolver=resolver, agree_within=10.0)
    m.step([], [Request(1, "x")])  # its resolution under way
    res = {}
    caller = threading.Thread(target=lambda: res.__setitem__("register", outcome(lambda: m.register("x", mine))))
    caller.start()
    wait_until(lambda: len(m._calls) == 1)
    release.set()
    wait_until(lambda: len(m._calls) == 2)  # the resolution's answer queued behind the registration
    for _ in range(100):
        step = m.step([], [Request(2, "x")])
        if step.admitted or step.failed:
            break
        time.sleep(0.01)
    caller.join(10)
    finish(m, world_size, (res, m.registry.resolve("x").digest, step.digest.get(2)), out)


def test_a_registration_and_a_resolution_of_one_name_in_one_round_leave_the_registration(tmp_path):
    make_adapter(tmp_path / "folders", name="x", seed=1, config=CONFIG)
    _, mine = make_adapter(tmp_path / "mine", name="x", seed=2, config=CONFIG)
    (res0, current0, served0), (res1, current1, served1) = spawn(same_round_rank, tmp_path,
                                                                 str(tmp_path / "folders"), str(mine), limit=90)
    spec = specs_from_config(CONFIG, max_rank=8, capacity=3)["language_model"]
    assert res0 == res1 == {"register": "ok"}
    assert current0 == current1 == served0 == served1 == check_adapter_file(spec, "x", mine), \
        "the user's file is served, not the resolver's"
