"""The manager's state for Prometheus: which adapter versions each tier holds, and what the manager has done.

A router that places requests where their adapter is resident reads mstar_lora_adapter_resident (llm-d's
scorer weighs an adapter in GPU memory above one in CPU memory above a free slot); the counters and the
read-latency histogram tell an operator whether the host tier is big enough. Needs prometheus_client
(`pip install 'mstar-lora[metrics]'`).
"""

from __future__ import annotations

from collections.abc import Iterator

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
except ImportError as e:  # an optional extra: say which
    raise ImportError("mstar.engine.resources.lora.metrics needs prometheus_client: "
                      "pip install 'mstar-lora[metrics]'") from e

from .manager import READ_SECONDS_BUCKETS, LoraManager

# counter name: (Counters field, what it counts)
COUNTERS = {
    "mstar_lora_reads": ("reads", "Adapter versions read into host memory."),
    "mstar_lora_read_failures": ("read_failures", "Reads that failed (the file gone, changed since its check, "
                                                  "unreadable); each fails its adapter's waiting requests."),
    "mstar_lora_host_hits": ("host_hits", "Requests whose adapter was in host memory when they first waited."),
    "mstar_lora_host_misses": ("host_misses", "Requests whose adapter had to be read when they first waited."),
    "mstar_lora_evictions": ("evictions", "Adapter versions the host tier dropped for room."),
    "mstar_lora_device_copies": ("device_copies", "Copies into device slots, one per target an adapter has."),
    "mstar_lora_failed_requests": ("failed_requests", "Requests refused because their adapter cannot be served."),
}


class LoraCollector:
    """A prometheus_client collector over one manager: register it on a CollectorRegistry, and every scrape
    reads the manager's public state as it is then (the stores, the pools, counters)."""

    def __init__(self, manager: LoraManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        c = self.manager.counters
        resident = GaugeMetricFamily("mstar_lora_adapter_resident", "1 for each adapter version resident in a "
                                     "tier: host memory (its copy read) or a device slot.",
                                     labels=["tier", "adapter", "version", "rank"])
        for tier, ranks in (("host", self.host_ranks()), ("device", self.device_ranks())):
            for key, rank in ranks.items():
                adapter, _, digest = key.rpartition("@")  # the tiers hold a version as name@digest16
                resident.add_metric([tier, adapter, digest, str(rank)], 1)
        yield resident
        for name, (field, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(c, field))
        cumulative, buckets = 0, []
        for bound, n in zip((*READ_SECONDS_BUCKETS, float("inf")), c.read_buckets, strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        yield HistogramMetricFamily("mstar_lora_read_seconds", "How long each adapter read took, from its start "
                                    "on a worker to its copy put in host memory.", buckets=buckets,
                                    sum_value=c.read_seconds)
        yield GaugeMetricFamily("mstar_lora_waiting_requests", "Requests the last step left waiting on an adapter.",
                                value=c.waiting_on_adapter)
        yield GaugeMetricFamily("mstar_lora_host_bytes", "Host memory the adapters' copies hold, every node.",
                                value=sum(s.nbytes for s in self.manager.stores.values()))
        yield from self.capacity()
        by_adapter = GaugeMetricFamily("mstar_lora_waiting_requests_by_adapter", "Requests the last step left "
                                       "waiting on each adapter (only adapters with some).", labels=["adapter"])
        for adapter, n in sorted(self.manager.waiting.items()):
            by_adapter.add_metric([adapter], n)
        yield by_adapter

    def capacity(self) -> Iterator[Metric]:
        """What a router sizes against: names registered and those not read yet, and each tier's room."""
        m = self.manager
        stores, pools = list(m.stores.values()), list(m.pools.values())
        host = self.host_ranks()
        current_in = sum(1 for k in host if m.registry.is_current(k))
        yield GaugeMetricFamily("mstar_lora_registered", "Adapter names registered.", value=len(m.registry))
        yield GaugeMetricFamily("mstar_lora_registered_unread", "Names registered whose current version is not "
                                "in host memory (never read yet, or evicted): a request for one waits on a read.",
                                value=len(m.registry) - current_in)
        slots = GaugeMetricFamily("mstar_lora_slots", "Device slots: capacity and used, as a count of adapters "
                                  "and in bytes (every node's slabs).", labels=["unit", "state"])
        used = sum(1 for k in pools[0].resident() if k is not None)
        per_slot = sum(sum(t.nbytes for t in p.slabs.values()) // p.slots for p in pools)
        slots.add_metric(["count", "capacity"], m.slots)
        slots.add_metric(["count", "used"], used)
        slots.add_metric(["bytes", "capacity"], per_slot * m.slots)
        slots.add_metric(["bytes", "used"], per_slot * used)
        yield slots
        tier = GaugeMetricFamily("mstar_lora_host_tier", "The host tier: capacity and used, as a count of adapter "
                                 "versions and in bytes (every node; no bytes capacity where it has no byte "
                                 "budget).", labels=["unit", "state"])
        tier.add_metric(["count", "capacity"], m.capacity)
        tier.add_metric(["count", "used"], len(host))
        if all(s.max_bytes is not None for s in stores):
            tier.add_metric(["bytes", "capacity"], sum(s.max_bytes for s in stores))
        tier.add_metric(["bytes", "used"], sum(s.nbytes for s in stores))
        yield tier

    def host_ranks(self) -> dict[str, int]:
        """Each version whose copy every node's store holds, with its rank (the largest over the nodes)."""
        stores = list(self.manager.stores.values())
        out = {}
        for key in stores[0].held():
            copies = [s.get(key) for s in stores]
            if all(a is not None for a in copies):
                out[key] = max(a.rank for a in copies)
        return out

    def device_ranks(self) -> dict[str, int]:
        """Each version in a slot of every node's pool, with its rank: the host copy's where there is one,
        else its slots' (the ranks each pool keeps beside a slot)."""
        pools = list(self.manager.pools.values())
        keys = [k for k in pools[0].resident() if k is not None and all(p.slot_of(k) is not None for p in pools)]
        host = self.host_ranks()
        return {k: host[k] if k in host else self.slot_rank(k) for k in keys}

    def slot_rank(self, key: str) -> int:
        """The largest rank of key's modules, from the ranks every node's pool keeps beside its slot."""
        return max(int(ranks[pool.slot_of(key)].max()) for pool in self.manager.pools.values()
                   for ranks in pool.ranks.values())
