"""What an engine and its manager pass each step, and what the manager keeps: a request as the manager sees
it, what a step decided, the manager's counters, and its state for one version."""

from __future__ import annotations

from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .registry import Version


class Request(NamedTuple):
    """A request as the manager sees it: the engine's id for it, and its adapter's name (None: the base model)."""

    id: Hashable
    adapter: str | None


@dataclass
class Step:
    """What one step decided. admitted: the waiting requests that can start now, in queue order, their
    adapters already in a device slot (on CUDA once ready has been waited on). failed: the waiting
    requests whose adapter cannot be served, with why. slot and digest: every running and admitted
    request's slot (-1 for the base model) and its adapter's digest, the root of its prefix-cache keys."""

    admitted: list[Hashable] = field(default_factory=list)
    failed: dict[Hashable, ValueError] = field(default_factory=dict)
    slot: dict[Hashable, int] = field(default_factory=dict)
    digest: dict[Hashable, bytes | None] = field(default_factory=dict)
    ready: torch.cuda.Event | None = None


# Upper bounds of the read-latency buckets, in seconds (a warm 84 MB read takes ~6 ms here, a cold disk far more).
READ_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Counters:
    """What the manager has done since it started; waiting is the last step's."""

    host_hits: int = 0  # requests whose adapter was in host memory when they first waited
    host_misses: int = 0
    reads: int = 0
    bytes_read: int = 0  # host bytes filled by reads, every node
    read_seconds: float = 0.0
    read_buckets: tuple[int, ...] = (0,) * (len(READ_SECONDS_BUCKETS) + 1)  # reads per bucket, the last past 10 s
    read_failures: int = 0
    evictions: int = 0  # adapters the host tier dropped for room
    device_copies: int = 0
    failed_requests: int = 0
    waiting_on_adapter: int = 0


@dataclass(eq=False)
class Entry:
    """One version the manager keeps: the read under way, if any, and why its last read failed, if it did.
    Whether it is in follows from the stores; who runs it, from the requests pinned to it."""

    version: Version
    reading: Future[None] | None = None
    error: ValueError | None = None
    registered: int = 0  # how many times it was registered: a read started before the last tells nothing
