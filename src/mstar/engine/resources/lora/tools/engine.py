"""A toy engine over LoraManager for the demo: continuous batching, a KV cache per request, greedy decoding.

Each step the engine gives the manager its running batch and its queue, starts what was admitted, runs
one forward per running request (its prompt first, then one token at a time on its own cache, each row
with its adapter's slot) and retires the requests that have all their tokens. Requests it hears of
while the forward runs are passed to prefetch, as an engine would.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..manager import Counters, LoraManager, Request, Step
from .hf import TokenSlots


@dataclass
class Job:
    """One request of the trace: the step it arrives at, its adapter (None: the base model), its prompt
    and how many tokens it wants; then what became of it."""

    id: str
    arrives: int
    adapter: str | None
    prompt: list[int]
    wants: int
    tokens: list[int] = field(default_factory=list)
    digest: bytes | None = None  # the version it was admitted with
    admitted_at: int | None = None
    error: ValueError | None = None
    cache: Any = field(default=None, repr=False)

    @property
    def request(self) -> Request:
        return Request(self.id, self.adapter)


class Engine:
    """The step loop: the manager decides admissions and slots, the model runs each request on its cache."""

    def __init__(self, manager: LoraManager, model: torch.nn.Module, slots: TokenSlots, device: torch.device,
                 report: Callable[[StepReport], None]) -> None:
        self.manager, self.model, self.slots, self.device, self.report = manager, model, slots, device, report
        # transformers 5 calls the KV cache `cache`, 4 `past_key_values`
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def run(self, jobs: list[Job], events: Mapping[int, Callable[[], None]], max_steps: int = 1000) -> None:
        """Every job to its end (all its tokens, or its failure), with events[n]() run before step n; a
        RuntimeError past max_steps (a read that never lands would otherwise keep its request waiting)."""
        queue: list[Job] = []
        running: list[Job] = []
        n, counters = 0, self.manager.counters
        while any(j.arrives >= n for j in jobs) or queue or running:
            if n == max_steps:
                raise RuntimeError(f"the trace is not done after {n} steps: {' '.join(j.id for j in queue)} still "
                                   f"wait, {' '.join(j.id for j in running)} still run")
            if n in events:
                events[n]()
            arrived = [j for j in jobs if j.arrives == n]
            queue += arrived
            step = self.manager.step([j.request for j in running], [j.request for j in queue])
            started = [j for j in queue if j.id in step.admitted]
            failed = [j for j in queue if j.id in step.failed]
            for j in started:
                j.digest, j.admitted_at = step.digest[j.id], n
            for j in failed:
                j.error = step.failed[j.id]
            queue = [j for j in queue if j not in started and j not in failed]
            running += started
            # the next step's arrivals reach the engine while this step's forward runs
            self.manager.prefetch([j.request for j in queue + [j for j in jobs if j.arrives == n + 1]])
            self.forward(step, running)
            done = [j for j in running if len(j.tokens) == j.wants]
            running = [j for j in running if j not in done]
            now = self.manager.counters
            if arrived or started or failed or done or running or now != counters:
                self.report(StepReport(n, arrived, started, failed, done, len(running), len(queue), counters, now,
                                       self.manager))
            else:
                time.sleep(0.01)  # nothing ran and nothing changed: an idle engine waits for reads or arrivals
            counters = now
            n += 1

    def forward(self, step: Step, running: list[Job]) -> None:
        """One token for each running request, on its own KV cache and with its adapter's slot."""
        if step.ready is not None:  # the slots' copies ran on a side stream
            torch.cuda.current_stream().wait_event(step.ready)
        with torch.no_grad():
            for j in running:
                ids = j.prompt if j.cache is None else j.tokens[-1:]
                self.slots.rows = torch.tensor([step.slot[j.id]], device=self.device)
                kw = {self.cache_arg: j.cache} if j.cache is not None else {}
                out = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=True, **kw)
                j.cache = out[self.cache_arg]
                j.tokens.append(int(out.logits[0, -1].argmax()))
                if len(j.tokens) == j.wants:
                    j.cache = None


@dataclass
class StepReport:
    """What one step did, for the per-step line: requests that arrived, started, failed and finished,
    what is left running and waiting, and the manager's counters before and after."""

    n: int
    arrived: list[Job]
    started: list[Job]
    failed: list[Job]
    done: list[Job]
    running: int
    waiting: int
    before: Counters
    after: Counters
    manager: LoraManager

    def delta(self, counter: str) -> int:
        return getattr(self.after, counter) - getattr(self.before, counter)
