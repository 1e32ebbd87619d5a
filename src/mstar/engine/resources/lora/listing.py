"""What a manager serves, as a listing pages through it: each registered name's current version, where it
is, and where it came from. Derived from the manager's state as it is when a page is asked for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .memory import WHERE

if TYPE_CHECKING:
    from .manager import LoraManager

# where a version is, from nearest the forward to farthest
SLOT, HOST, READING, FAILED, REGISTERED = "slot", "host", "reading", "failed", "registered"


@dataclass(frozen=True)
class AdapterInfo:
    """One name and its current version: version is the tiers' key (name@digest16), digest the full digest in
    hex (the prefix-cache root); where is slot (in a device slot, every node), host (its copy read), reading
    (a read under way), failed (its read failed: error says why, and new requests are refused until it is
    registered again) or registered (not read yet: read when a request first needs it); source is the path,
    the Hub snapshot, the object-store URL or <pushed tensors> it was checked from."""

    name: str
    version: str
    digest: str
    where: str
    source: str
    error: str | None = None


@dataclass(frozen=True)
class Page:
    """One page of a listing, in name order; next is the after= of the next page (None: this was the last)."""

    adapters: list[AdapterInfo]
    next: str | None


def page(m: LoraManager, after: str | None = None, limit: int = 100) -> Page:
    if limit < 1:
        raise ValueError(f"a page lists at least one adapter, not {limit}")
    rows = m.registry.page(after, limit + 1)
    more, rows = len(rows) > limit, rows[:limit]
    out = []
    for v, error in rows:
        with m._lock:
            entry = m._entries.get(v.key)
            reading = entry is not None and entry.reading is not None
        if error is not None:
            where = FAILED
        elif all(p.slot_of(v.key) is not None for p in m.pools.values()):
            where = SLOT
        elif all(s.get(v.key) is not None for s in m.stores.values()):
            where = HOST
        else:
            where = READING if reading else REGISTERED
        source = str(v.path) if v.path is not None else str(WHERE)  # a path, or a Remote as its URL
        out.append(AdapterInfo(v.name, v.key, v.digest.hex(), where, source, None if error is None else str(error)))
    return Page(out, out[-1].name if more and out else None)
