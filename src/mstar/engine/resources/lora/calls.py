"""Calls that change what a manager serves, from any thread, agreed by every rank at one point of a step.

A register, push, unregister or resolution is checked where it is made (a file hashed on the caller's
thread), then queued. The step applies the queue at its start: every rank reaches that point in the same
order, so a reload arriving on an HTTP thread never crosses a collective the engine thread is in. With a
process group the ranks first agree, in one small all_reduce every step, whether any rank has a call
queued; only then do they gather the queues and apply the calls every rank has made, in rank 0's order,
each with the outcome every rank computes alike from the gathered checks. A call that only some ranks
have made waits for the others, and is refused on the ranks that made it (a ValueError saying so) once it
has waited `within` seconds by rank 0's clock: never a hang.

The k-th call of a kind and names on one rank is matched with the k-th of the same kind and names on
every other rank; a call made on the engine thread itself is agreed at once, by a round that every rank
must make at the same point (a header tag says which kind of round each rank is in, so a rank stepping
while another registers gets a ValueError on both, not crossed collectives).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .registry import Version
from .versions import Checked, outcome

STEP, SYNC = 1, 2  # the round a rank is in: a step, or a call made on the engine thread


@dataclass(eq=False)
class Call:
    """One call as queued: its kind (register, unregister, resolve), the names it is about, what this rank's
    check of each gave (a version, or why not), and the future its caller waits on."""

    kind: str
    names: tuple[str, ...]
    checked: Mapping[str, Checked] = field(default_factory=dict)
    seq: int = 0
    done: Future = field(default_factory=Future)

    def describe(self) -> tuple:
        """What every rank sees of this call: kind, names, and each name's digest or refusal."""
        return (self.seq, self.kind, self.names,
                {n: c.digest if isinstance(c, Version) else c for n, c in self.checked.items()})


class Calls:
    """The queue of calls not yet applied, and their agreement."""

    def __init__(self, group: dist.ProcessGroup | None, within: float) -> None:
        self.group, self.within = group, within
        self._lock = threading.Lock()
        self._queue: list[Call] = []
        self._seq = 0
        self._first_seen: dict[int, float] = {}  # own call's seq -> rank 0's clock when first gathered

    def put(self, kind: str, names: tuple[str, ...], checked: Mapping[str, Checked] | None = None) -> Call:
        with self._lock:
            self._seq += 1
            call = Call(kind, names, dict(checked or {}), self._seq)
            self._queue.append(call)
            return call

    def drop(self, call: Call) -> None:
        with self._lock:
            self._queue = [c for c in self._queue if c is not call]

    def __len__(self) -> int:
        return len(self._queue)

    def agree(self, round_: int = STEP) -> list[tuple[Call, dict[str, Version] | ValueError]]:
        """The calls every rank applies now, in the order every rank applies them, each with its outcome.
        With a group, a collective every rank makes, in the same round; calls only some ranks made stay
        queued, and those that waited past `within` are refused (their callers told)."""
        with self._lock:
            mine = list(self._queue)
            if self.group is None:  # taken at once: two threads applying never both take a call
                self._queue.clear()
        if self.group is None:
            return [(c, outcome(c.checked, [c.describe()[3]])) for c in mine]
        header = torch.tensor([round_, -round_, len(mine)], dtype=torch.int64)
        dist.all_reduce(header, op=dist.ReduceOp.MAX, group=self.group)
        low, high, pending = -int(header[1]), int(header[0]), int(header[2])
        if low != high:
            raise ValueError("the ranks' managers are in different calls: one steps while another registers, "
                             "pushes or unregisters on its engine thread. Every rank makes such calls at the same "
                             "point of its loop; from another thread they wait for the next step instead")
        if pending == 0:
            return []
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, (time.monotonic(), [c.describe() for c in mine]), group=self.group)
        return self._match(everyone, mine)

    def _match(self, everyone: list, mine: list[Call]) -> list[tuple[Call, dict[str, Version] | ValueError]]:
        me, now = dist.get_rank(self.group), everyone[0][0]
        lists = [calls for _, calls in everyone]
        # each rank's calls by (kind, names), in its order: the k-th of one rank goes with the k-th of each other
        by_key = [{} for _ in lists]
        for r, calls in enumerate(lists):
            for i, (_, kind, names, _) in enumerate(calls):
                by_key[r].setdefault((kind, names), []).append(i)
        applied, matched = [], set()
        for i, (_, kind, names, _) in enumerate(lists[0]):
            k = by_key[0][kind, names].index(i)
            members = [by_key[r].get((kind, names), []) for r in range(len(lists))]
            if any(len(m) <= k for m in members):
                continue
            mine_at = members[me][k]
            matched.add(mine_at)
            seen = [lists[r][members[r][k]][3] for r in range(len(lists))]
            applied.append((mine[mine_at], outcome(mine[mine_at].checked, seen)))
        late = []
        for i, call in enumerate(mine):
            if i in matched:
                continue
            first = self._first_seen.setdefault(call.seq, now)
            if now - first > self.within:
                late.append(call)
                others = [r for r in range(len(lists)) if not any(d[1:3] == (call.kind, call.names)
                                                                   for d in lists[r])]
                call.done.set_exception(ValueError(
                    f"adapter {', '.join(map(repr, call.names))}: {call.kind} was called on rank {me} but not on "
                    f"rank {', '.join(map(str, others))} within {self.within:g} s; with a process group every rank "
                    "makes each call (the engine's scheduler decides once), so it is not applied anywhere"))
        gone = matched | {mine.index(c) for c in late}
        with self._lock:
            taken = {id(mine[i]) for i in gone}
            self._queue = [c for c in self._queue if id(c) not in taken]
        for i in gone:
            self._first_seen.pop(mine[i].seq, None)
        return applied
