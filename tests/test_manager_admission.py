"""The manager's admission at its edges: a host budget met to the byte, the queue's order kept under a budget,
and a running request that names another adapter than the one it was admitted with."""

from __future__ import annotations

import pytest
from managers import one_node, settle
from tiny import make_adapter

from mstar.engine.resources.lora.manager import LoraManager, Request


def manager(max_bytes: int | None = None) -> LoraManager:
    return one_node(slots=4, max_bytes=max_bytes)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("admission")
    targets = {"small": ["q_proj"], "middle": ["q_proj", "o_proj"], "big": None}
    paths = {n: make_adapter(root, name=n, seed=i + 1, **({"target_modules": t} if t else {}))[1]
             for i, (n, t) in enumerate(targets.items())}
    probe = manager()
    sizes = {n: probe.register(n, p).nbytes["language_model"] for n, p in paths.items()}
    probe.close()
    assert sizes["small"] < sizes["middle"] < sizes["big"]
    return paths, sizes


def test_an_adapter_exactly_the_size_of_the_host_budget_is_served(adapters):
    paths, sizes = adapters
    m = manager(max_bytes=sizes["big"])
    m.register("big", paths["big"])
    assert settle(m, [], [Request(1, "big")]).admitted == [1]
    with pytest.raises(ValueError, match=rf"its copy takes {sizes['big']} host bytes for language_model, over the "
                                         rf"host budget of {sizes['big'] - 1}"):
        manager(max_bytes=sizes["big"] - 1).register("big", paths["big"])


def test_a_smaller_adapter_later_in_the_queue_does_not_take_the_room_an_earlier_one_waits_for(adapters):
    paths, sizes = adapters
    m = manager(max_bytes=sizes["big"] + sizes["small"])  # middle and big cannot be held together
    for n, p in paths.items():
        m.register(n, p)
    assert settle(m, [], [Request(0, "middle")]).admitted == [0]
    running, waiting = [Request(0, "middle")], [Request(1, "big"), Request(2, "small")]
    assert settle(m, running, waiting).admitted == [], "big waits for room, and small waits behind it"
    held = m.stores["language_model"].held()
    assert [k.split("@")[0] for k in held] == ["middle"]
    step = settle(m, [], waiting)  # middle's request is done: big and small fit together
    assert step.admitted == [1, 2]


def test_a_running_request_naming_another_adapter_than_it_was_admitted_with_is_refused(adapters):
    paths, _ = adapters
    m = manager()
    m.register("small", paths["small"])
    m.register("middle", paths["middle"])
    assert settle(m, [], [Request(7, "small")]).admitted == [7]
    with pytest.raises(ValueError, match="request 7 runs adapter 'middle' without this manager having admitted it"):
        m.step([Request(7, "middle")], [])
