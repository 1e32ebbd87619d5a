"""What the tensor-parallel ranks agree on: one collective a step for every adapter's state.

Each rank knows only its own copies and its own failed reads. A batch may use an adapter only once
every rank has it, and a read that fails on one rank fails that adapter everywhere, so each rank's
state per adapter is reduced by its minimum over the ranks: FAILED anywhere wins, then MISSING.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

FAILED, MISSING, READY = -1, 0, 1
T = TypeVar("T")


def agree(states: Sequence[int], group: dist.ProcessGroup | None) -> list[int]:
    """Each entry's minimum over the ranks of group (every rank passes the same entries, in order)."""
    if group is None or not states:
        return list(states)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor(states, dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return t.tolist()


def gather_reasons(reasons: dict[str, str], group: dist.ProcessGroup | None) -> dict[str, str]:
    """Each key's reason from whichever rank has one: what a failure agreed by agree() was, for the
    ranks whose own read succeeded. Called only in steps where agree() reported a failure, on every rank."""
    if group is None:
        return dict(reasons)
    everyone: list[dict[str, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, reasons, group=group)
    merged: dict[str, str] = {}
    for theirs in everyone:
        for key, why in (theirs or {}).items():
            merged.setdefault(key, why)
    return merged


def same_everywhere(value: T, group: dist.ProcessGroup | None) -> list[T]:
    """value as every rank of group has it (what each checked at a registration, say). Every rank calls it
    for every registration, whether its own check passed or not, so no rank waits on one that gave up."""
    if group is None:
        return [value]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone
