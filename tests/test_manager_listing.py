"""What a manager serves, listed and paged; the router's metrics; names that cost little until used; and
serving the good adapters of a startup config with each file hashed once."""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import sys
import threading
import tracemalloc

import pytest
from managers import one_node, settle
from tiny import make_adapter

from mstar.engine.resources.lora import Version
from mstar.engine.resources.lora.check import check_adapter_file
from mstar.engine.resources.lora.manager import Request


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("listing")
    return {n: make_adapter(root, name=n, seed=i + 1)[1] for i, n in enumerate("abcd")}


def test_the_listing_says_where_each_version_is_and_pages_in_name_order(adapters, tmp_path):
    m = one_node(capacity=3, slots=1)
    broken = tmp_path / "broken"
    shutil.copytree(adapters["d"], broken)
    versions = {n: m.register(n, adapters[n]) for n in "abc"}
    versions["d"] = m.register("d", broken)
    (broken / "adapter_model.safetensors").write_bytes(b"")  # its read fails
    settle(m, [], [Request(1, "a")])  # a in the slot
    settle(m, [Request(1, "a")], [Request(2, "b")])  # b read, no slot free beside a
    step = settle(m, [Request(1, "a")], [Request(2, "b"), Request(3, "d")])
    assert 3 in step.failed
    pages, after = [], None
    while True:
        page = m.adapters(after=after, limit=3)
        pages.append(page.adapters)
        if page.next is None:
            break
        after = page.next
    assert [len(p) for p in pages] == [3, 1]
    rows = {r.name: r for p in pages for r in p}
    assert [r.name for p in pages for r in p] == ["a", "b", "c", "d"]
    assert {n: r.where for n, r in rows.items()} == {"a": "slot", "b": "host", "c": "registered", "d": "failed"}
    assert all(rows[n].digest == versions[n].digest.hex() and rows[n].version == versions[n].key for n in rows)
    assert rows["a"].source == str(adapters["a"]) and rows["d"].source == str(broken)
    assert rows["d"].error.startswith("adapter 'd' (") and rows["a"].error is None
    m.unregister("b")
    assert [r.name for r in m.adapters().adapters] == ["a", "c", "d"], "a name unregistered leaves the listing"
    m.close()



def test_names_registered_from_their_own_folders_cost_under_a_kilobyte_each(adapters, tmp_path):
    """As a deployment registers them: each name checked at a folder of its own (hard links of one file), so
    nothing but what a registration keeps is shared."""
    m = one_node()
    folders = []
    for i in range(600):
        folder = tmp_path / f"tenant-adapter-{i:05d}"
        folder.mkdir()
        for f in adapters["a"].iterdir():
            os.link(f, folder / f.name)
        folders.append(folder)
    m.register("warm", folders[0])
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i, folder in enumerate(folders):
        m.register(f"tenant-{i:06d}", folder)
    m.adapters(limit=1)  # the listing's order is kept too
    gc.collect()
    per_name = (tracemalloc.get_traced_memory()[0] - base) / len(folders)
    tracemalloc.stop()
    # the bound is 1 KB; the README says about 450 bytes (a Path and a dict of sizes a name took 1 KB)
    assert per_name <= 600, f"a registered name costs {per_name:.0f} bytes before its first use"
    m.close()


def test_a_listing_racing_registrations_never_keeps_a_stale_order(adapters):
    m = one_node()
    v = m.check_all({"a": adapters["a"]})["a"]
    stop, seen = threading.Event(), []

    def lister():
        while not stop.is_set():
            seen.append(len(m.adapters(limit=1).adapters))

    threads = [threading.Thread(target=lister) for _ in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch at every chance: a sort and a change of names interleave
    for t in threads:
        t.start()
    try:
        for round_ in range(40):
            names = [f"r{round_}-{i:04d}" for i in range(500)]
            m.register_all({n: dataclasses.replace(v, name=n) for n in names})
            assert [r.name for r in m.adapters(limit=10**6).adapters] == sorted(m.registry._current), \
                f"round {round_}: the listing lost or kept names the registry does not have"
            for n in names[::2]:
                m.unregister(n)
            assert [r.name for r in m.adapters(limit=10**6).adapters] == sorted(m.registry._current)
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)
    assert len(seen) > 100
    m.close()

def test_a_page_past_the_last_name_is_empty_and_a_zero_limit_refused(adapters):
    m = one_node()
    m.register("a", adapters["a"])
    assert m.adapters(after="a").adapters == [] and m.adapters(after="a").next is None
    with pytest.raises(ValueError, match="at least one adapter"):
        m.adapters(limit=0)
    m.close()


def test_names_cost_their_version_alone_until_used_and_unregistering_gives_it_back(adapters):
    m = one_node()
    checked = m.check_all({"a": adapters["a"]})["a"]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    m.register_all({f"n{i}": dataclasses.replace(checked, name=f"n{i}") for i in range(5000)})
    gc.collect()
    per_name = (tracemalloc.get_traced_memory()[0] - base) / 5000
    for i in range(5000):
        m.unregister(f"n{i}")
    gc.collect()
    left = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert per_name <= 1024, f"a registered name costs {per_name:.0f} bytes before its first use"
    assert left < 64 * 1024, f"{left} bytes stay after every name was unregistered"
    step = settle(m, [], [Request(1, "n1")])
    assert step.failed[1].args[0] == "adapter 'n1' is not registered"
    m.close()


def test_the_good_adapters_of_a_config_are_served_with_each_file_hashed_once(adapters, tmp_path, monkeypatch):
    import mstar.engine.resources.lora.versions as versions

    m = one_node()
    hashed = []
    real = versions.check_checkpoint
    monkeypatch.setattr(versions, "check_checkpoint", lambda *a, **kw: hashed.append(1) or real(*a, **kw))
    config = {"a": adapters["a"], "b": adapters["b"], "gone": tmp_path / "gone"}
    with pytest.raises(ValueError, match="1 of 3 adapters cannot be served"):
        m.register_all(config)  # all or nothing, as a startup check must be
    assert len(m.registry) == 0
    hashed.clear()
    checked = m.check_all(config)
    good = {n: v for n, v in checked.items() if isinstance(v, Version)}
    assert set(good) == {"a", "b"} and "no such file" in checked["gone"]
    m.register_all(good)
    assert len(hashed) == 2, "a and b hashed once each, by check_all; register_all hashed nothing again"
    spec = m.stores["language_model"].spec
    assert m.registry.resolve("b").digest == check_adapter_file(spec, "b", adapters["b"])
    step = settle(m, [], [Request(1, "a"), Request(2, "b")])
    assert step.admitted == [1, 2]
    m.close()
