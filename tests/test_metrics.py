"""LoraCollector: the manager's tiers and counters, read back through prometheus_client's own exposition."""

from __future__ import annotations

import threading
import time

import pytest
from managers import one_node, settle
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tiny import make_adapter

from mstar.engine.resources.lora import LoraAdapterStore
from mstar.engine.resources.lora.manager import READ_SECONDS_BUCKETS, LoraManager, Request
from mstar.engine.resources.lora.metrics import LoraCollector

RANKS = {"a": 2, "b": 4, "c": 6, "d": 2}


class SlowStore(LoraAdapterStore):
    """A store whose reads take 10 ms longer (a disk slower than the page cache: a read never lands before
    the step that started it counts its miss), c's 30 ms, and whose reads of d wait until the test lets
    them go."""

    go = threading.Event()

    def read(self, name, path, digest=None):
        time.sleep(0.03 if name == "c" else 0.01)
        if name == "d":
            assert self.go.wait(timeout=60), "the test never let d's read go"
        return super().read(name, path, digest)


def manager(capacity=2, slots=3) -> LoraManager:
    return one_node(capacity, slots, SlowStore)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    return {n: make_adapter(root, name=n, seed=i + 1, r=r)[1] for i, (n, r) in enumerate(RANKS.items())}


def scrape(m: LoraManager) -> dict[str, list]:
    """Every sample the collector exports, by metric name, as a Prometheus server would read them."""
    registry = CollectorRegistry()
    registry.register(LoraCollector(m))
    families = text_string_to_metric_families(generate_latest(registry).decode())
    return {f.name: f.samples for f in families}


def value(samples, name: str, **labels) -> float:
    [v] = [s.value for s in samples if s.name == name and all(s.labels.get(k) == w for k, w in labels.items())]
    return v


def resident(samples, tier: str) -> set[tuple[str, str, str]]:
    return {(s.labels["adapter"], s.labels["version"], s.labels["rank"]) for s in samples
            if s.labels["tier"] == tier and s.value == 1}


def test_residency_follows_the_tiers_with_each_adapters_rank(adapters):
    m = manager(capacity=2, slots=3)
    versions = {n: m.register(n, adapters[n]) for n in "abc"}
    for i, n in enumerate("abc"):  # one after another: c's hold pushes a out of host memory, not out of its slot
        assert settle(m, [], [Request(i, n)]).admitted == [i]
    got = scrape(m)["mstar_lora_adapter_resident"]
    entry = {n: (n, v.digest.hex()[:16], str(RANKS[n])) for n, v in versions.items()}  # as PEFT saved them
    assert resident(got, "host") == {entry["b"], entry["c"]}, "capacity 2: a was evicted"
    assert resident(got, "device") == set(entry.values()), "a's rank is read from its slot"
    m.close()


def test_a_reload_shows_both_versions_until_the_old_ones_last_request_is_done(tmp_path, adapters):
    m = manager(capacity=4, slots=3)
    old = m.register("a", adapters["a"])
    settle(m, [], [Request(1, "a")])
    _, path = make_adapter(tmp_path, name="a2", seed=9, r=4)
    new = m.register("a", path)
    settle(m, [Request(1, "a")], [Request(2, "a")])
    assert resident(scrape(m)["mstar_lora_adapter_resident"], "device") == {
        ("a", old.digest.hex()[:16], "2"), ("a", new.digest.hex()[:16], "4")}
    m.step([Request(2, "a")], [])
    got = scrape(m)["mstar_lora_adapter_resident"]
    assert resident(got, "device") == resident(got, "host") == {("a", new.digest.hex()[:16], "4")}
    m.close()


def test_counters_and_the_read_histogram_match_what_the_manager_did(tmp_path, adapters):
    m = manager(capacity=2, slots=3)
    for n, p in adapters.items():
        m.register(n, p)
    _, broken = make_adapter(tmp_path, name="broken", seed=5)
    m.register("broken", broken)
    (broken / "adapter_model.safetensors").unlink()
    for i, n in enumerate("abc"):  # three reads and misses; c's hold evicts a
        assert settle(m, [], [Request(i, n)]).admitted == [i]
    # two misses and one failed read, failing both requests; broken's hold evicts b
    assert set(settle(m, [], [Request(10, "broken"), Request(11, "broken")]).failed) == {10, 11}
    SlowStore.go.clear()
    step = m.step([], [Request(12, "d"), Request(13, "c")])  # d's read is held back: a miss, waiting; c a hit
    assert step.admitted == [13]
    got = scrape(m)
    SlowStore.go.set()
    for name, want in [("reads", 3), ("read_failures", 1), ("failed_requests", 2), ("evictions", 2),
                       ("host_misses", 6), ("host_hits", 1), ("device_copies", 3 * 4)]:  # 4 targets an adapter
        assert value(got[f"mstar_lora_{name}"], f"mstar_lora_{name}_total") == want, name
    assert value(got["mstar_lora_waiting_requests"], "mstar_lora_waiting_requests") == 1
    assert value(got["mstar_lora_host_bytes"], "mstar_lora_host_bytes") == m.stores["language_model"].nbytes > 0
    h = got["mstar_lora_read_seconds"]
    assert value(h, "mstar_lora_read_seconds_count") == 3
    assert value(h, "mstar_lora_read_seconds_sum") == pytest.approx(m.counters.read_seconds)
    buckets = [(float(s.labels["le"]), s.value) for s in h if s.name == "mstar_lora_read_seconds_bucket"]
    assert [b for b, _ in buckets] == [*READ_SECONDS_BUCKETS, float("inf")]
    counts = [n for _, n in buckets]
    assert counts == sorted(counts) and counts[-1] == 3
    assert value(h, "mstar_lora_read_seconds_bucket", le="0.025") <= 2, "c's read took over 30 ms"
    m.close()


def test_an_idle_manager_exports_every_metric_at_zero():
    got = scrape(manager())
    assert resident(got["mstar_lora_adapter_resident"], "host") == set()
    for name in ("reads", "read_failures", "host_hits", "host_misses", "evictions", "device_copies",
                 "failed_requests"):
        assert value(got[f"mstar_lora_{name}"], f"mstar_lora_{name}_total") == 0
    assert value(got["mstar_lora_read_seconds"], "mstar_lora_read_seconds_count") == 0
    assert value(got["mstar_lora_host_bytes"], "mstar_lora_host_bytes") == 0


def test_a_router_sees_names_not_read_each_tier_s_room_and_requests_waiting_per_adapter(adapters):
    m = one_node(capacity=2, slots=1, max_bytes=10**9)
    for n in "abc":
        m.register(n, adapters[n])
    settle(m, [], [Request(1, "a")])
    settle(m, [Request(1, "a")], [Request(2, "b"), Request(3, "b"), Request(4, "c")])
    s = scrape(m)
    pool, store = m.pools["language_model"], m.stores["language_model"]
    per_slot = sum(t.nbytes for t in pool.slabs.values())
    assert value(s["mstar_lora_registered"], "mstar_lora_registered") == 3
    assert value(s["mstar_lora_registered_unread"], "mstar_lora_registered_unread") == 1, "c waits for room"
    assert value(s["mstar_lora_slots"], "mstar_lora_slots", unit="count", state="capacity") == 1
    assert value(s["mstar_lora_slots"], "mstar_lora_slots", unit="count", state="used") == 1
    assert value(s["mstar_lora_slots"], "mstar_lora_slots", unit="bytes", state="capacity") == per_slot
    assert value(s["mstar_lora_host_tier"], "mstar_lora_host_tier", unit="count", state="capacity") == 2
    assert value(s["mstar_lora_host_tier"], "mstar_lora_host_tier", unit="count", state="used") == 2
    assert value(s["mstar_lora_host_tier"], "mstar_lora_host_tier", unit="bytes", state="capacity") == 10**9
    assert value(s["mstar_lora_host_tier"], "mstar_lora_host_tier", unit="bytes", state="used") == store.nbytes
    by = s["mstar_lora_waiting_requests_by_adapter"]
    assert {x.labels["adapter"]: x.value for x in by} == {"b": 2, "c": 1}, "b has no slot beside a; c no room"
    m.close()
