"""Random serving traces through the manager: whatever arrives, finishes, reloads or lands when, no batch
uses more adapters than slots, every request's slot holds its own adapter's weights, and a running
request's adapter is never evicted."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import LoraAdapterStore, LoraDevicePool, specs_from_config
from mstar.engine.resources.lora.manager import LoraManager, Request
from mstar.engine.resources.lora.registry import Version

CONFIG = model_config("llama")
NAMES = ["a", "b", "c", "d"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two versions of every adapter name."""
    root = tmp_path_factory.mktemp("props")
    return {(n, v): make_adapter(root, name=f"{n}{v}", seed=10 * i + v, r=2 + i)[1]
            for i, n in enumerate(NAMES) for v in (0, 1)}


# One round: requests arriving, running ones finishing, maybe a reload or an unregistration, whether
# the reads under way land before the step, then the step.
rounds = st.lists(st.tuples(
    st.lists(st.sampled_from([*NAMES, None]), max_size=4),
    st.lists(st.integers(0, 7), max_size=3),
    st.one_of(st.none(), st.tuples(st.sampled_from(["reload", "unregister"]), st.sampled_from(NAMES))),
    st.booleans(),
), min_size=3, max_size=25)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rounds, st.integers(1, 3), st.integers(1, 4))
def test_every_step_keeps_the_rules(files, trace, slots, capacity):
    spec = specs_from_config(CONFIG, max_rank=8, capacity=capacity, dtype=torch.float32)["language_model"]
    store, pool = LoraAdapterStore(spec, pin=False), LoraDevicePool(spec, slots, dtype=torch.float32)
    m = LoraManager({"language_model": store}, {"language_model": pool}, read_workers=2)
    current = {n: 0 for n in NAMES}
    for n in NAMES:
        m.register(n, files[n, 0])
    waiting: list[Request] = []
    running: dict[int, tuple[Request, Version]] = {}
    next_id = 0
    for arrivals, finishes, change, land in trace:
        for name in arrivals:
            waiting.append(Request(next_id, name))
            next_id += 1
        for i in finishes:
            if running:
                del running[sorted(running)[i % len(running)]]
        if change and change[0] == "reload":
            current[change[1]] = 1 - current[change[1]]
            m.register(change[1], files[change[1], current[change[1]]])
        elif change:
            m.unregister(change[1])
        if land:
            m.wait_for_reads()
        step = m.step([r for r, _ in running.values()], waiting)
        for r in waiting:
            if r.id in step.admitted and r.adapter is not None:
                running[r.id] = (r, m.registry.resolve(r.adapter))
        waiting = [r for r in waiting if r.id not in step.admitted and r.id not in step.failed]
        assert_rules(m, store, pool, running, step, slots)
    m.close()


def assert_rules(m, store, pool, running, step, slots):
    versions = {v.key for _, v in running.values()}
    assert len(versions) <= slots, "no batch uses more adapters than device slots"
    for rid, (_, v) in running.items():
        assert step.digest[rid] == v.digest, "a request keeps the weights it was admitted with"
        slot = step.slot[rid]
        assert pool.resident()[slot] == v.key, "its slot holds its adapter"
        copy = store.get(v.key)
        assert copy is not None, "a running request's adapter is never evicted from the host tier"
        for t in pool.a:
            want_a = copy.a[t] if t in copy.a else torch.zeros_like(pool.a[t][slot])
            assert torch.equal(pool.a[t][slot], want_a), f"slot {slot} holds {v.key}'s weights"
