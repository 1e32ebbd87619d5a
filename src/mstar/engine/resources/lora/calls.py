"""Calls that change what a manager serves, from any thread, agreed by every rank at one point of a step.

A register, push, unregister or resolution is checked where it is made (a file hashed on the caller's
thread), then queued. The step applies the queue at its start: every rank reaches that point in the same
order, so a reload arriving on an HTTP thread never crosses a collective the engine thread is in. With a
process group the ranks first agree, in one small all_reduce every step, whether any rank has a call
queued; only then do they gather the queues and apply the calls every rank has made, in rank 0's order,
each with the outcome every rank computes alike from the gathered checks.

The k-th call of a kind and names on one rank is matched with the k-th of the same kind and names on
every other rank. A call that only some ranks have made waits for the others; once it has waited `within`
seconds by rank 0's clock (reckoned from the gathered queues, so every rank reckons alike) it is refused
on the ranks that made it, applied nowhere; a resolution or a forgetting is instead applied on every rank
at that step as a failure (or a forgetting), so no rank waits on a name another rank gave up on. A round
that ends part way (a collective failed: a rank gone, the group's timeout; or an interrupt) may leave the
ranks out of step for good: every call queued or taken, and every one made later, is refused saying so, and
the manager's steps too, so no caller waits on a group that cannot agree and no collective crosses another.

A call made on the engine thread itself is agreed at once, by a round that every rank must make at the
same point (a header tag says which kind of round each rank is in). Where one rank is in such a round while
another steps, the stepping rank tries its round again and the call stays queued on the other, its caller
told so (Deferred): the next step applies it where every rank made it. Never crossed collectives.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .objects import short
from .registry import Version
from .versions import Checked, outcome

STEP, SYNC = 1, 2  # the round a rank is in: a step, or a call made on the engine thread
EVERYWHERE = ("resolve", "forget")  # kinds a rank applies whoever made them, once they are late
GRACE = 1.0  # seconds a call waits for a partner that checked the same files before one that read others


class Deferred(ValueError):
    """A call made on the engine thread while another rank stepped: not applied now, queued for the next step."""


@dataclass(eq=False)
class Call:
    """One call as queued: its kind (register, unregister, resolve, forget), the names it is about, what this
    rank's check of each gave (a version, or why not), and the future its caller waits on."""

    kind: str
    names: tuple[str, ...]
    checked: Mapping[str, Checked] = field(default_factory=dict)
    seq: int = 0
    done: Future = field(default_factory=Future)
    in_round: bool = False  # taken into a round of agreement now: the round decides it, not its caller
    last_round: float = -math.inf  # when a round last took it in (this rank's monotonic clock)

    def describe(self) -> tuple:
        """What every rank sees of this call: kind, names, and each name's digest or refusal."""
        return (self.seq, self.kind, self.names,
                {n: c.digest if isinstance(c, Version) else c for n, c in self.checked.items()})


Applied = tuple[Call, dict[str, Version] | ValueError]


class Calls:
    """The queue of calls not yet applied, and their agreement."""

    def __init__(self, group: dist.ProcessGroup | None, within: float) -> None:
        self.group, self.within = group, within
        self._lock = threading.Lock()
        self._queue: list[Call] = []
        self._seq = 0
        self._first_seen: dict[tuple[int, int], float] = {}  # (rank, seq) -> rank 0's clock when first gathered
        self.closed: str | None = None  # why calls are refused now (the manager was closed, or broken), the first
        self.broken: str | None = None  # why the ranks may be out of step (a round ended part way), if they may

    def put(self, kind: str, names: tuple[str, ...], checked: Mapping[str, Checked] | None = None) -> Call:
        with self._lock:
            self._seq += 1
            call = Call(kind, names, dict(checked or {}), self._seq)
            if self.closed is None:
                self._queue.append(call)
            else:
                call.done.set_exception(_not_applied(call, self.closed))
            return call

    def _take(self) -> list[Call]:
        """The queue as a round sees it (under the lock): each call in it held by the round."""
        now = time.monotonic()
        for c in self._queue:
            c.in_round, c.last_round = True, now
        return list(self._queue)

    def _release(self) -> None:
        """The round over: the calls it left queued are their callers' to give up again (under the lock)."""
        for c in self._queue:
            c.in_round = False

    def drop(self, call: Call) -> None:
        with self._lock:
            self._queue = [c for c in self._queue if c is not call]

    def abandon(self, call: Call) -> bool:
        """call taken off the queue if no round holds it and none took it in for within seconds (no step came:
        an unmatched call is applied nowhere, and once off this rank's queue no round can match it): whether
        it was."""
        with self._lock:
            if call.in_round or call not in self._queue or time.monotonic() - call.last_round < self.within:
                return False
            self._queue.remove(call)
            return True

    def settle(self, call: Call, result: Any) -> None:
        """call's caller told its outcome (a ValueError raised), unless it was told already (a close racing)."""
        with self._lock:
            if call.done.done():
                return
            if isinstance(result, BaseException):
                call.done.set_exception(result)
            else:
                call.done.set_result(result)

    def close(self, why: str) -> None:
        """Every queued call refused with why, its caller told; calls put later are refused at once."""
        with self._lock:
            queue, self._queue, self.closed = self._queue, [], self.closed or why
        for call in queue:
            self.settle(call, _not_applied(call, self.closed))

    def drop_kind(self, kind: str, name: str) -> None:
        """Every queued call of kind about name dropped (a resolution that another rank's failure overtook)."""
        with self._lock:
            self._queue = [c for c in self._queue if not (c.kind == kind and c.names == (name,))]

    def __len__(self) -> int:
        return len(self._queue)

    def agree(self, round_: int = STEP) -> list[Applied]:
        """The calls every rank applies now, in the order every rank applies them, each with its outcome.
        With a group, collectives every rank makes, in the same round: a step tries again while another rank
        is in an engine-thread call's round; that call is Deferred (left queued) instead."""
        with self._lock:
            mine = self._take()
            if self.group is None:  # taken at once: two threads applying never both take a call
                self._queue.clear()
        if self.group is None:
            return [(c, outcome(c.checked, [c.describe()[3]])) for c in mine]
        try:
            return self._round(round_, mine)
        except Deferred:
            raise
        except BaseException as e:  # a collective failed (a rank gone, a timeout), or an interrupt part way
            self.fail(e, mine)
            raise

    def fail(self, e: BaseException, taken: list[Call] | tuple[Call, ...] = ()) -> None:
        """A round (a step's, or a call's) ended part way on this rank, by e: the ranks may be out of step for
        good, so no call is agreed any more. The calls queued and taken, and every later one, refused saying
        so; broken says why (the manager's steps are refused too)."""
        try:
            rank = f"rank {dist.get_rank(self.group)}"
        except Exception:  # a group already let go
            rank = "this rank"
        why = (f"a round of this manager's process group ended part way on {rank} ({short(e)}): its ranks may no "
               "longer agree, so it makes no collective any more; close it and build it on a new group")
        with self._lock:
            self.broken = self.broken or why
        self.close(self.broken)
        for call in taken:
            self.settle(call, _not_applied(call, self.broken))

    def interrupted(self, taken: list[Call], e: BaseException) -> None:
        """Without a group: the calls a round took whose callers were not told yet, told that it was interrupted
        (e) before or while it applied them."""
        for call in taken:
            self.settle(call, ValueError(f"adapter {', '.join(map(repr, call.names))}: {call.kind} was interrupted "
                                         f"as it was applied ({short(e)}): not applied, or in part; call it again"))

    def _round(self, round_: int, mine: list[Call]) -> list[Applied]:
        while True:
            header = torch.tensor([round_, -round_, len(mine)], dtype=torch.int64)
            dist.all_reduce(header, op=dist.ReduceOp.MAX, group=self.group)
            if int(header[0]) == -int(header[1]):
                break
            if round_ == SYNC:
                with self._lock:
                    self._release()
                raise Deferred("another rank was stepping")
            with self._lock:  # the other rank gives its round up and steps: try again, with what is queued now
                mine = self._take()
        if int(header[2]) == 0:
            with self._lock:
                self._release()
            return []
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, (time.monotonic(), [c.describe() for c in mine]), group=self.group)
        return self._match(everyone, mine)

    def _match(self, everyone: list, mine: list[Call]) -> list[Applied]:
        me, now = dist.get_rank(self.group), everyone[0][0]
        lists = [calls for _, calls in everyone]
        grace = min(GRACE, self.within / 2)
        groups = _pairs(lists, lambda i: now - self._first_seen.get((0, lists[0][i][0]), now) >= grace)
        applied, matched = [], [set() for _ in lists]
        for i in sorted(groups):  # in rank 0's order
            members = groups[i]
            for r, j in enumerate(members):
                matched[r].add(j)
            seen = [lists[r][j][3] for r, j in enumerate(members)]
            call = mine[members[me]]
            applied.append((call, outcome(call.checked, seen)))
        gone = set(matched[me])
        applied += self._late(lists, matched, now, mine, gone)
        with self._lock:
            taken = {id(mine[i]) for i in gone}
            self._queue = [c for c in self._queue if id(c) not in taken]
            self._release()
        return applied

    def _late(self, lists: list, matched: list[set[int]], now: float, mine: list[Call], gone: set[int]) \
            -> list[Applied]:
        """The unmatched calls that waited past within, by the same reckoning on every rank: a register or
        unregister refused on the ranks that made it; a resolution failed, a forgetting applied, on every rank."""
        me, seen, out, everywhere = dist.get_rank(self.group), set(), [], set()
        for r, calls in enumerate(lists):
            for i, (seq, kind, names, _) in enumerate(calls):
                if i in matched[r]:
                    self._first_seen.pop((r, seq), None)
                    continue
                seen.add((r, seq))
                first = self._first_seen.setdefault((r, seq), now)
                if now - first <= self.within:
                    continue
                self._first_seen.pop((r, seq))
                why = self._why(kind, names, r, [q for q in range(len(lists))
                                                 if not any(d[1:3] == (kind, names) for d in lists[q])])
                if kind in EVERYWHERE:
                    if (kind, names) not in everywhere:  # once, on every rank alike
                        everywhere.add((kind, names))
                        out.append((Call(kind, names), why))
                    if r == me:
                        gone.add(i)
                elif r == me:
                    self.settle(mine[i], why)
                    gone.add(i)
        for key in [k for k in self._first_seen if k not in seen]:  # dropped by their ranks meanwhile
            del self._first_seen[key]
        return out

    def _why(self, kind: str, names: tuple[str, ...], r: int, missing: list[int]) -> ValueError:
        others = ", ".join(map(str, missing)) or "(another call of the same kind)"
        if kind == "resolve":
            return ValueError(f"adapter {names[0]!r} is not registered, and its resolution landed on rank {r} but "
                              f"not on rank {others} within {self.within:g} s (agree_within): every rank resolves "
                              "a name itself, and every rank's answer must land within that of the others'")
        return ValueError(f"adapter {', '.join(map(repr, names))}: {kind} was called on rank {r} but not on rank "
                          f"{others} within {self.within:g} s; with a process group every rank makes each call (the "
                          "engine's scheduler decides once), so it is not applied anywhere")


def _pairs(lists: list[list[tuple]], ripe: Callable[[int], bool]) -> dict[int, list[int]]:
    """Each call of rank 0 that every rank has made, with its index on each rank. Calls of one kind and names
    are paired with those that checked the same files first (two reloads of a name queued in another order on
    each rank, in one round or across two, are each paired with its own), then the rest: the k-th of one rank
    with the k-th of each other, where a rank refused its check at once, and where the ranks read different
    weights only once rank 0's call is ripe (it waited GRACE seconds for a partner of the same files)."""
    groups: dict[int, list[int]] = {}
    taken: list[set[int]] = [set() for _ in lists]
    same_files, same_names = (lambda d: (d[1], d[2], repr(sorted(d[3].items())))), (lambda d: (d[1], d[2]))
    for key in (same_files, same_names):
        by_key: list[dict] = [{} for _ in lists]
        for r, calls in enumerate(lists):
            for i, d in enumerate(calls):
                if i not in taken[r]:
                    by_key[r].setdefault(key(d), []).append(i)
        for i, d in enumerate(lists[0]):
            if i in taken[0]:
                continue
            k = by_key[0][key(d)].index(i)
            members = [by_key[r].get(key(d), []) for r in range(len(lists))]
            if any(len(m) <= k for m in members):
                continue
            pair = [m[k] for m in members]
            refused = any(isinstance(c, str) for r, j in enumerate(pair) for c in lists[r][j][3].values())
            if key is same_names and not refused and not ripe(i):
                continue
            groups[i] = pair
            for r, j in enumerate(pair):
                taken[r].add(j)
    return groups


def _not_applied(call: Call, why: str) -> ValueError:
    return ValueError(f"adapter {', '.join(map(repr, call.names))}: {call.kind} was not applied: {why}")
