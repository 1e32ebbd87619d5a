"""The adapter manager: the pool's protocol, run by an engine once per scheduler step.

The engine gives each step's running batch and waiting queue. The manager holds the batch's
adapters (keep = the batch), then the queue's in order as far as the host tier's capacity allows;
reads each newly held one on background workers and puts it when it lands; agrees with the other
ranks, in one collective, which adapters are in everywhere and which failed; and admits the waiting
requests whose adapter is in and fits a device slot, copying it in (on CUDA, on a side stream the
forward waits on). A step never waits on a read: a request whose adapter is not in yet waits.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist

from . import listing
from .calls import STEP, Calls
from .disk_tier import DiskTier
from .listing import Page
from .models import specs_from_config
from .objects import Remote
from .pool import LoraDevicePool
from .protocol import READ_SECONDS_BUCKETS, Counters, Entry, Request, Step
from .ranks import FAILED, MISSING, READY, gather_reasons
from .ranks import agree as agree_states
from .registrations import Registrations
from .registry import Registry, Version
from .resolution import Resolution
from .store import LoraAdapterStore
from .versions import check_path, named


class LoraManager(Registrations):
    """The engine's side of the pool: registration, per-step admission, background reads, agreement.

    Every rank steps alike (the engine's scheduler decides once); registrations may come from any
    thread and are applied at a step, where every rank applies the same ones (calls.py). With a
    process group, registrations, readiness and failures are agreed by collectives every rank makes,
    failing or not, so ranks never use different adapters and never wait on each other forever.
    stores and pools are keyed by node (the language model, a vision tower); an adapter is in once
    every node's store has it.
    """

    def __init__(self, stores: Mapping[str, LoraAdapterStore], pools: Mapping[str, LoraDevicePool], *,
                 group: dist.ProcessGroup | None = None, read_workers: int = 4, agree_within: float = 30.0,
                 resolver: Callable[[str], Any] | None = None, unknown_for: float = 30.0,
                 resolver_timeout: float = 120.0, disk_tier: DiskTier | None = None,
                 engine_thread: bool = True) -> None:
        if set(stores) != set(pools) or not stores:
            raise ValueError(f"one store and one pool per node, not stores {sorted(stores)} and pools {sorted(pools)}")
        if len({p.slots for p in pools.values()}) != 1:
            raise ValueError("every node's pool needs the same number of slots, so an adapter has one slot")
        self.stores, self.pools, self.group = dict(stores), dict(pools), group
        self.registry = Registry()
        self.slots = next(iter(pools.values())).slots
        self.capacity = min(s.spec.capacity for s in stores.values())
        # by version key: the versions held, being read, or failed, made at their first hold (a registered name
        # costs its Version alone until a request uses it) and dropped once their copy is gone
        self._entries: dict[str, Entry] = {}
        self._pinned: dict[Hashable, Version] = {}  # running request -> the version it was admitted with
        self._seen: set[Hashable] = set()
        self._lock = threading.Lock()  # entries' reads and errors, the stores' puts beside the step's holds
        self._workers = ThreadPoolExecutor(read_workers, thread_name_prefix="mstar-lora-manager")
        self._counters = Counters()
        self._waiting: Counter[str] = Counter()  # by adapter, the requests the last step left waiting
        self._calls = Calls(group, agree_within)
        self._disk_tier = disk_tier
        self._resolution = None if resolver is None else Resolution(
            resolver, lambda name, source: check_path(self.stores, name, source, disk=self.disk_tier), self._calls,
            unknown_for, timeout=resolver_timeout)
        # calls.py's engine thread: the one that stepped last (before any step, the one that built it), unless
        # engine_thread=False
        self._engine: int | None = threading.get_ident()
        self._engine_thread = engine_thread
        self._stepping: int | None = None  # the thread in a step now
        self._closed = False
        self._on_worker = threading.local()  # .yes on the read workers' threads
        self._rounds = threading.RLock()  # a step's collectives, or an engine-thread call's round: never interleaved
        device = next(iter(pools.values())).device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @classmethod
    def build(cls, config: Any, *, max_rank: int, host_capacity: int, slots: int, device: str | torch.device = "cpu",
              rank: int = 0, world_size: int = 1, group: dist.ProcessGroup | None = None,
              dtype: torch.dtype = torch.bfloat16, pin: bool | None = None, read_workers: int = 4,
              host_bytes: int | None = None, max_expert_rank: int | None = None, **options: Any) -> LoraManager:
        """A manager with a store and a pool for every node of the model config describes; host_bytes,
        if given, is each store's byte budget beside its count; max_expert_rank a mixture of experts'
        experts node's max_rank (default max_rank); options the constructor's (resolver, disk_tier,
        unknown_for, resolver_timeout, agree_within, engine_thread)."""
        specs = specs_from_config(config, max_rank=max_rank, capacity=host_capacity, dtype=dtype,
                                  max_expert_rank=max_expert_rank)
        stores = {n: LoraAdapterStore(s, rank, world_size, pin=pin, max_bytes=host_bytes) for n, s in specs.items()}
        pools = {n: LoraDevicePool(s, slots, device, rank, world_size) for n, s in specs.items()}
        return cls(stores, pools, group=group, read_workers=read_workers, **options)

    # --- the step ------------------------------------------------------------------------

    def step(self, running: Sequence[Request], waiting: Sequence[Request]) -> Step:
        """This step's admissions, failures and slots (see Step). Never waits on a read. With a group, a step
        that raises part way (a collective failed, an interrupt) leaves the ranks out of step: the manager
        makes no collective after it, and its steps and calls are refused saying why."""
        me = threading.get_ident()
        self._refuse_ended("step")  # before the lock too: an engine stepping on after close never starves it
        with self._rounds:
            self._refuse_ended("step")
            pins = self._pins(running)  # refused before any collective: the ranks stay in step
            self._stepping, self._engine = me, me if self._engine_thread else None
            try:
                return self._step(pins, waiting)
            except BaseException as e:
                if self.group is not None:
                    self._calls.fail(e)
                raise
            finally:
                self._stepping = None

    def _step(self, pins: dict[Hashable, Version | None], waiting: Sequence[Request]) -> Step:
        self._apply(STEP)
        out = Step()
        batch = list(dict.fromkeys(v for v in pins.values() if v is not None))
        wanted: dict[Hashable, Version] = {}
        for r in waiting:
            if r.adapter is None:
                continue
            v = self.registry.resolve(r.adapter)
            if isinstance(v, ValueError) and self._resolution is not None and r.adapter not in self.registry:
                v = self._resolution.wanted(r.adapter)  # None: it waits while its name is resolved
                if v is None:
                    continue
            if isinstance(v, ValueError):
                out.failed[r.id] = v
            else:
                wanted[r.id] = v
        prefetched = self._hold(batch, list(dict.fromkeys(wanted.values())))
        self._count_first_waits(waiting, wanted)
        states, errors = self._agree(prefetched)
        states.update((v.key, READY) for v in batch)  # admitted once in everywhere, and kept since
        active, activate = {v.key for v in batch}, []
        for r in waiting:
            v = wanted.get(r.id)
            if r.adapter is None:
                out.admitted.append(r.id)
                pins[r.id] = None
            elif v is None:
                continue
            elif states.get(v.key) == FAILED:
                out.failed[r.id] = errors[v.key]
            elif states.get(v.key) == READY and (v.key in active or len(active) < self.slots):
                if v.key not in active:
                    active.add(v.key)
                    activate.append(v)
                out.admitted.append(r.id)
                pins[r.id] = v
        out.ready = self._activate(activate, active)
        settled = set(out.admitted) | set(out.failed)
        slots = {v: self._slot(v) for v in set(pins.values()) if v is not None}
        for rid, v in pins.items():
            out.slot[rid] = -1 if v is None else slots[v]
            out.digest[rid] = None if v is None else v.digest
        self._pinned = {rid: v for rid, v in pins.items() if v is not None}
        self._collect()
        for store in self.stores.values():
            store.trim()
        with self._lock:
            c = self._counters
            c.failed_requests += len(out.failed)
            left = Counter(r.adapter for r in waiting if r.id not in settled and r.adapter is not None)
            c.waiting_on_adapter, self._waiting = sum(left.values()), left
            c.device_copies = sum(p.copies for p in self.pools.values())
        return out

    def prefetch(self, waiting: Sequence[Request]) -> None:
        """Hold the queue's adapters and start their reads as step would, admitting nothing: for an engine
        that hears of requests while the forward runs; names not registered start resolving. Every rank
        calls it alike, as it calls step."""
        self._refuse_ended("prefetch")
        with self._rounds:  # ordered with close as a step is: nothing starts resolving once it is closed
            self._refuse_ended("prefetch")
            batch = list(dict.fromkeys(self._pinned.values()))
            if self._resolution is not None:  # names no one registered: resolution started now, not next step
                for r in waiting:
                    if r.adapter is not None and r.adapter not in self.registry:
                        self._resolution.wanted(r.adapter)
            queue = [v for r in waiting if r.adapter is not None
                     for v in [self.registry.resolve(r.adapter)] if not isinstance(v, ValueError)]
            self._hold(batch, list(dict.fromkeys(queue)))

    def _pins(self, running: Sequence[Request]) -> dict[Hashable, Version | None]:
        """The version each running request was admitted with (a reload does not move it)."""
        pins: dict[Hashable, Version | None] = {}
        for r in running:
            if r.adapter is None:
                pins[r.id] = None
            elif r.id in self._pinned and self._pinned[r.id].name == r.adapter:
                pins[r.id] = self._pinned[r.id]
            else:
                raise ValueError(f"request {r.id!r} runs adapter {r.adapter!r} without this manager having admitted it")
        return pins

    def _hold(self, batch: list[Version], queue: list[Version]) -> list[Version]:
        """Hold the batch's versions, then the queue's in order while the host tier has room for them
        beside the batch; start a read for each one held whose copy is not in. The queue's versions held,
        in order."""
        keep = {v.key for v in batch}
        used = {n: sum(v.nbytes[n] for v in batch) for n in self.stores}
        for v in batch:
            self._hold_one(v, keep)
        held = []
        for v in queue:
            if v.key in keep:
                continue
            fits = all(s.max_bytes is None or used[n] + v.nbytes[n] <= s.max_bytes for n, s in self.stores.items())
            if len(keep) >= self.capacity or not fits:
                break  # in queue order: a later, smaller adapter does not overtake one waiting for room
            keep.add(v.key)
            for n in used:
                used[n] += v.nbytes[n]
            self._hold_one(v, keep)
            held.append(v)
        return held

    def _hold_one(self, v: Version, keep: set[str]) -> None:
        """Hold v in every node's store and, under the lock that its reads land under, start a read unless
        its copy is in, a read is under way or its last one failed: so a copy evicted and held again
        while its read lands is never left held with no copy and no read."""
        store = next(iter(self.stores.values()))  # every node's store holds the same names
        with self._lock:
            before = len(store)
            new = [s.hold(v.key, keep, v.nbytes[n]) for n, s in self.stores.items()]
            self._counters.evictions += before + new[0] - len(store)
            entry = self._entries.get(v.key)
            if entry is None:
                entry = self._entries[v.key] = Entry(v)
            if entry.reading is None and entry.error is None and not self._in(v):
                entry.reading = self._workers.submit(self._read, entry, entry.registered)

    def _read(self, entry: Entry, registered: int) -> None:
        """entry's version read for every node and put, or its failure recorded: on a worker, outside every
        lock but for the put. A failure is not recorded if the version was registered again meanwhile (the
        file fixed, say): the next hold reads it anew."""
        v, start = entry.version, time.perf_counter()
        copies: dict[str, Any] | None = {}
        self._on_worker.yes = True  # close() from here does not wait on this thread
        try:
            with ExitStack() as stack:
                path = stack.enter_context(self.disk_tier().local(v.path)) if isinstance(v.path, Remote) else v.path
                for n, s in self.stores.items():
                    copies[n] = s.read(v.name, path, v.digest) if v.tensors is None else \
                        s.read_tensors(v.name, v.tensors, v.config, v.digest)
        except Exception as e:  # a read's refusal is a ValueError naming adapter and file; anything else is wrapped
            error = ValueError(*e.args) if isinstance(e, ValueError) else ValueError(
                f"adapter {v.name!r} ({v.path}): {e!r}")
            error = _recoverable(named(error, v.name, v.path, self.disk_tier()) if isinstance(v.path, Remote)
                                 else error, v)
            copies = None  # neither the copies read so far nor the failed read's frames stay alive
        else:
            error = None
        with self._lock:
            entry.reading = None
            if error is not None:
                self._counters.read_failures += 1
                if entry.registered == registered:
                    entry.error = error
                return
            for n, s in self.stores.items():
                s.put(dataclasses.replace(copies[n], name=v.key))
            c = self._counters
            c.reads += 1
            c.bytes_read += sum(a.nbytes for a in copies.values())
            seconds = time.perf_counter() - start
            c.read_seconds += seconds
            i = bisect.bisect_left(READ_SECONDS_BUCKETS, seconds)
            c.read_buckets = (*c.read_buckets[:i], c.read_buckets[i] + 1, *c.read_buckets[i + 1 :])

    def _agree(self, versions: list[Version]) -> tuple[dict[str, int], dict[str, ValueError]]:
        """Each version's state on every rank (one collective), and why each that failed anywhere did:
        such a version is dropped everywhere and its name refused until registered again."""
        with self._lock:
            failures = {v.key: e.error for v in versions if (e := self._entries.get(v.key)) and e.error is not None}
        mine = [FAILED if v.key in failures else READY if self._in(v) else MISSING for v in versions]
        states = dict(zip((v.key for v in versions), agree_states(mine, self.group), strict=True))
        failed = [v for v in versions if states[v.key] == FAILED]
        errors: dict[str, ValueError] = {}
        if failed:
            reasons = gather_reasons({k: str(e) for k, e in failures.items()}, self.group)
            for v in failed:
                errors[v.key] = failures.get(v.key) or ValueError(reasons.get(v.key, f"adapter {v.name!r} "
                                                                                   f"({v.path}): its read failed"))
                for s in self.stores.values():
                    s.drop(v.key)
                with self._lock:  # a reload registered meanwhile from another thread is not failed with it
                    if self._resolution is not None and v.name in self._resolution.resolved \
                            and self.registry.is_current(v.key):
                        self.registry.unregister(v.name)  # resolved anew by the next request that names it
                        self._resolution.resolved.discard(v.name)
                    else:
                        self.registry.fail(v, errors[v.key])
                    entry = self._entries.get(v.key)
                    if entry is not None:
                        entry.error = None  # told: the name is refused now, until it is registered again
        return states, errors

    def _in(self, v: Version) -> bool:
        return all(s.get(v.key) is not None for s in self.stores.values())

    def _activate(self, versions: list[Version], active: set[str]) -> torch.cuda.Event | None:
        """versions copied into device slots, never taking one an active version holds; on CUDA on the
        side stream, after the work already queued (the last forward may still read a slot)."""
        if self._stream is None:
            for v in versions:
                self._copy_in(v, active)
            return None
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            for v in versions:
                self._copy_in(v, active)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    def _copy_in(self, v: Version, active: set[str]) -> None:
        for n, pool in self.pools.items():
            pool.activate(self.stores[n].get(v.key), keep=active)

    def _slot(self, v: Version) -> int:
        slots = {p.slot_of(v.key) for p in self.pools.values()}
        if len(slots) != 1 or None in slots:
            raise RuntimeError(f"adapter {v.key!r} is in slots {slots} of the nodes' pools")
        return slots.pop()

    def _collect(self) -> None:
        """Drop every version no longer current that no running request uses, from host and device."""
        pinned = {v.key for v in self._pinned.values()}

        def stale(key: str | None) -> bool:
            return key is not None and not self.registry.is_current(key) and key not in pinned

        for n, store in self.stores.items():
            for key in filter(stale, store.held()):
                store.drop(key)
            for key in filter(stale, self.pools[n].resident()):
                self.pools[n].deactivate(key)
        with self._lock:
            held = set(store.held())  # every node's store holds the same names
            for key in [k for k, e in self._entries.items()
                        if e.reading is None and (stale(k) or (e.error is None and k not in held))]:
                del self._entries[key]

    def _count_first_waits(self, waiting: Sequence[Request], wanted: dict[Hashable, Version]) -> None:
        ids = {r.id for r in waiting}
        fresh = [v for rid, v in wanted.items() if rid not in self._seen]
        self._seen = (self._seen & ids) | set(wanted)
        with self._lock:
            for v in fresh:
                if self._in(v):
                    self._counters.host_hits += 1
                else:
                    self._counters.host_misses += 1

    def adapters(self, after: str | None = None, limit: int = 100) -> Page:
        """What the manager serves, one page at a time in name order (listing.py): each name's current
        version, digest, where it is (slot, host, reading, failed and why, registered) and its source.
        Start with after=None, then pass each page's next until it is None."""
        return listing.page(self, after, limit)

    @property
    def waiting(self) -> dict[str, int]:
        """The requests the last step left waiting on their adapter, by adapter name."""
        with self._lock:
            return dict(self._waiting)

    @property
    def counters(self) -> Counters:
        """A snapshot of what the manager has done so far."""
        with self._lock:
            return dataclasses.replace(self._counters)

    def wait_for_reads(self, timeout: float | None = None) -> bool:
        """Block until every read and resolution under way has landed or failed, or timeout seconds have
        passed: whether they all did. An engine with nothing to run calls it (with a timeout, so that new
        requests are heard of) instead of stepping in a spin; tests, benchmarks and shutdown without one.
        Never within a step."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = [e.reading for e in self._entries.values() if e.reading is not None]
            until = deadline
            if self._resolution is not None:
                self._resolution.expire()  # one past resolver_timeout fails (its failure applied at the next step)
                pending += self._resolution.pending()
                until = min(until, self._resolution.next_deadline())
            if not pending:
                return True
            if deadline <= time.monotonic():
                return False
            wait(pending, timeout=None if until == math.inf else max(0.0, until - time.monotonic()))


def _recoverable(error: ValueError, v: Version) -> ValueError:
    """error, saying how to recover where pushed tensors changed since their push."""
    text = str(error)
    if v.tensors is not None and "changed since they were pushed" in text:
        return ValueError(f"{text}. Push them again to serve what they hold now, or push with copy=True to "
                          "serve what they held at the push (a copy of their bytes, kept while it is served)")
    return error
