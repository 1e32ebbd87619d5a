"""Names learnt when a request names them: resolved, checked and read off the step, admitted alike by every rank.

A request naming an adapter no one registered waits while a worker asks the resolver for its source and
checks it (fetching it into the disk tier first where it is remote). What the worker found is a call like
any registration (calls.py): applied at a step, on every rank once every rank has resolved it, so every
rank admits its requests at the same step. A name no source has, or whose check failed, fails its
requests with why, and is remembered as such for unknown_for seconds, so a misspelled name does not hammer
the store; that memory too is let go by a call every rank makes, so no rank forgets it a step early.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .calls import Calls
from .objects import short
from .resolvers import where
from .versions import Checked


class Resolution:
    """The names being resolved, and those known to have no adapter (agreed by every rank), with why."""

    def __init__(self, resolver: Callable[[str], Any], check: Callable[[str, Any], Checked], calls: Calls,
                 unknown_for: float, workers: int = 4) -> None:
        self.resolver, self.check, self.calls, self.unknown_for = resolver, check, calls, unknown_for
        self.where = where(resolver)
        self._lock = threading.Lock()
        self._resolving: set[str] = set()
        self._futures: set[Future] = set()
        self._unknown: dict[str, tuple[ValueError, float]] = {}  # name -> (why, when this rank lets it go)
        self._expiring: deque[str] = deque()  # unknown names, in the order their time runs out
        self.resolved: set[str] = set()  # names registered by a resolution, not by a call
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="mstar-lora-resolve")

    def wanted(self, name: str) -> ValueError | None:
        """Why name's requests fail now, or None: they wait while it is resolved (started here if need be)."""
        known = self._unknown.get(name)
        if known is not None:
            return known[0]
        with self._lock:
            if name in self._resolving:
                return None
            self._resolving.add(name)
        future = self._workers.submit(self._resolve, name)
        self._futures.add(future)
        future.add_done_callback(self._futures.discard)
        return None

    def pending(self) -> list[Future]:
        """The resolutions under way (each ends by queueing its call, which the next step applies)."""
        return list(self._futures)

    def _resolve(self, name: str) -> None:
        try:
            source = self.resolver(name)
        except Exception as e:  # a resolver that raised, or a store that is down: this name's failure alone
            checked: Checked = f"adapter {name!r} is not registered, and {self.where} could not be asked ({short(e)})"
        else:
            checked = (f"adapter {name!r} is not registered, and {self.where} has no such adapter"
                       if source is None else self.check(name, source))
        self.calls.put("resolve", (name,), {name: checked})

    def applied(self, name: str, error: ValueError | None) -> None:
        """name's resolution applied at this step, on every rank: registered, or known to have no adapter."""
        with self._lock:
            self._resolving.discard(name)
        if error is not None:
            self._unknown[name] = (error, time.monotonic() + self.unknown_for)
            self._expiring.append(name)
        else:
            self.resolved.add(name)

    def expire(self) -> None:
        """Queue a forget call for each unknown name whose time ran out on this rank."""
        now = time.monotonic()
        while self._expiring and (self._unknown.get(self._expiring[0], (None, 0.0))[1] <= now):
            name = self._expiring.popleft()
            if name in self._unknown:
                self.calls.put("forget", (name,))

    def forget(self, name: str) -> None:
        self._unknown.pop(name, None)

    def close(self) -> None:
        self._workers.shutdown(wait=True)
