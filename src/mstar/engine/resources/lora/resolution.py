"""Names learnt when a request names them: resolved, checked and read off the step, admitted alike by every rank.

A request naming an adapter no one registered waits while a worker asks the resolver for its source and
checks it (fetching it into the disk tier first where it is remote). What the worker found is a call like
any registration (calls.py): applied at a step, on every rank once every rank has resolved it, so every
rank admits its requests at the same step. A name no source has, or whose check failed, fails its
requests with why, and is remembered as such for unknown_for seconds, so a misspelled name does not hammer
the store; that memory too is let go by a call every rank makes, so no rank forgets it a step early.

A resolution that has not answered within `timeout` seconds (a resolver that hangs, a store that stalls)
fails its name as one with no source would, and its worker, whenever it returns, is not heard; one that
raises anything at all (a BaseException too) fails its name alone. At most `workers` resolutions run at
once; one past its time no longer counts among them, so hung resolvers never hold the others back.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from .calls import Calls
from .objects import short
from .resolvers import where
from .versions import Checked


@dataclass(eq=False)
class Resolving:
    """One name's resolution under way: its token (a later resolution of the name has another), when it
    runs out of time (inf once its answer is queued, or before it started), and what waits on it."""

    token: int
    deadline: float = math.inf
    started: bool = False
    done: Future = field(default_factory=Future)


class Resolution:
    """The names being resolved, and those known to have no adapter (agreed by every rank), with why."""

    def __init__(self, resolver: Callable[[str], Any], check: Callable[[str, Any], Checked], calls: Calls,
                 unknown_for: float, workers: int = 4, timeout: float = 120.0) -> None:
        self.resolver, self.check, self.calls, self.unknown_for = resolver, check, calls, unknown_for
        self.workers, self.timeout = workers, timeout
        self.where = where(resolver)
        self._lock = threading.Lock()
        self._resolving: dict[str, Resolving] = {}
        self._queued: deque[str] = deque()  # names waiting for a worker, in the order they were wanted
        self._running = 0  # workers started that have neither answered nor run out of time
        self._tokens = itertools.count()
        self._threads: set[threading.Thread] = set()
        self._unknown: dict[str, tuple[ValueError, float]] = {}  # name -> (why, when this rank lets it go)
        self._expiring: deque[str] = deque()  # unknown names, in the order their time runs out
        self.resolved: set[str] = set()  # names registered by a resolution, not by a call

    def wanted(self, name: str) -> ValueError | None:
        """Why name's requests fail now, or None: they wait while it is resolved (started here if need be)."""
        known = self._unknown.get(name)
        if known is not None:
            return known[0]
        with self._lock:
            if name not in self._resolving:
                self._resolving[name] = Resolving(next(self._tokens))
                self._queued.append(name)
                self._start()
        return None

    def pending(self) -> list[Future]:
        """The resolutions under way (each ends by queueing its call, which the next step applies)."""
        with self._lock:
            return [r.done for r in self._resolving.values() if not r.done.done()]

    def _start(self) -> None:
        """Workers started for queued names while fewer than workers run (under the lock)."""
        while self._queued and self._running < self.workers:
            name = self._queued.popleft()
            r = self._resolving.get(name)
            if r is None or r.started or r.done.done():
                continue
            r.started, r.deadline = True, time.monotonic() + self.timeout
            self._running += 1
            t = threading.Thread(target=self._resolve, args=(name, r), name="mstar-lora-resolve", daemon=True)
            self._threads.add(t)
            t.start()

    def _resolve(self, name: str, r: Resolving) -> None:
        try:
            try:
                source = self.resolver(name)
            except BaseException as e:  # a resolver that raised, or a store that is down: this name's failure alone
                checked: Checked = f"adapter {name!r} is not registered, and {self.where} could not be asked " \
                                   f"({short(e)})"
            else:
                checked = (f"adapter {name!r} is not registered, and {self.where} has no such adapter"
                           if source is None else self.check(name, source))
        except BaseException as e:  # the check itself raised past its refusals
            checked = f"adapter {name!r}: its check failed ({short(e)})"
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())
        self._answer(name, r, checked)

    def _answer(self, name: str, r: Resolving, checked: Checked) -> None:
        """r's answer queued as a call, unless r ran out of time or was overtaken meanwhile; its worker freed."""
        with self._lock:
            if r.done.done():  # ran out of time: its worker no longer counted, its answer not heard
                return
            r.deadline = math.inf
            if self._resolving.get(name) is r:
                self.calls.put("resolve", (name,), {name: checked})
            self._running -= 1
            r.done.set_result(None)
            self._start()

    def applied(self, name: str, error: ValueError | None, heard: bool = True) -> None:
        """name's resolution applied at this step, on every rank: registered, or known to have no adapter
        (unless not heard: a registration of the name came first, and stands). A resolution of it still under
        way here (another rank's answer, or its lateness, came first) is not heard."""
        self.overtaken(name, keep=True)
        if not heard:
            return
        with self._lock:
            if error is not None:
                self._unknown[name] = (error, time.monotonic() + self.unknown_for)
                self._expiring.append(name)
            else:
                self.resolved.add(name)

    def overtaken(self, name: str, keep: bool = False) -> None:
        """name registered or unregistered by a call, at a step every rank makes: its resolution under way is
        not heard, and what a resolution left of it (a registration, a failure remembered) is let go, unless
        keep (its own resolution applied)."""
        with self._lock:
            r = self._resolving.pop(name, None)
            if r is not None and not r.done.done():
                self._running -= r.deadline < math.inf
                r.done.set_result(None)
                self._start()
            self.calls.drop_kind("resolve", name)
            if not keep:
                self.resolved.discard(name)
                self._unknown.pop(name, None)

    def next_deadline(self) -> float:
        """When the first resolution under way runs out of time (monotonic clock; inf if none)."""
        with self._lock:
            return min((r.deadline for r in self._resolving.values() if not r.done.done()), default=math.inf)

    def expire(self) -> None:
        """Queue a failure for each resolution past its time, and a forget call for each unknown name whose
        time ran out on this rank. From any thread (a step, a call's round, wait_for_reads)."""
        now = time.monotonic()
        with self._lock:
            late = [(n, r) for n, r in self._resolving.items() if r.deadline <= now and not r.done.done()]
            for name, r in late:
                why = f"adapter {name!r} is not registered, and {self.where} did not answer within {self.timeout:g} s"
                self.calls.put("resolve", (name,), {name: why + " (resolver_timeout)"})
                self._running -= 1
                r.deadline = math.inf
                r.done.set_result(None)
            if late:
                self._start()
            while self._expiring and (self._unknown.get(self._expiring[0], (None, 0.0))[1] <= now):
                name = self._expiring.popleft()
                if name in self._unknown:
                    self.calls.put("forget", (name,))

    def forget(self, name: str) -> None:
        with self._lock:
            self._unknown.pop(name, None)
            self.calls.drop_kind("forget", name)

    def close(self, timeout: float = 5.0) -> None:
        """Wait up to timeout seconds for the resolutions under way (a hung resolver's thread is left to itself:
        it is a daemon, and its answer is never heard; a resolver that closes the manager is not waited for by
        itself). Nothing wants a name after it: the manager's steps and prefetches are refused once closed."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._queued.clear()
            for r in self._resolving.values():  # never to start: nothing waits on them
                if not r.started and not r.done.done():
                    r.done.set_result(None)
            threads = [t for t in self._threads if t is not threading.current_thread()]  # a resolver closing
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
