"""The slot layout: how one adapter's target lies in host memory and in a device slot, alike.

With R = max_rank, a target's block is a [layers, slices * R, in_shard] and then, at the next
ALIGN-byte boundary, b [layers, out_shard, R]. Module (layer l, slice s, rank r) fills rows
s*R : s*R + r of a[l] and, in b[l], the rows of slice s this rank holds, columns 0 : r; every
other element is zero. The host tier's buffer holds an adapter's blocks back to back, and a device
slab's row is one block, so a target moves in one copy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

from .spec import LoraSpec, LoraTarget, Shard, bfloat16

if TYPE_CHECKING:
    import torch

# Blocks and b start at multiples of this, so every view is aligned for any dtype and vector load.
ALIGN = 256


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class HostDtype(NamedTuple):
    """A dtype as a layout's sizes need it, without torch: its name as torch gives it and its itemsize. What
    mstar-lora check lays its specs and layouts out in, sizing host bytes without importing torch; a store or a
    pool, which makes tensors, takes a torch.dtype."""

    name: str
    itemsize: int

    def __str__(self) -> str:
        return self.name


HOST_DTYPES = {d.name: d for d in (HostDtype("bfloat16", 2), HostDtype("float16", 2), HostDtype("float32", 4))}


@dataclass(frozen=True)
class TargetLayout:
    """One target's block on one rank: shapes, where b starts, and where each slice lies."""

    target: LoraTarget
    max_rank: int
    shard: Shard
    dtype: torch.dtype

    @cached_property
    def a_shape(self) -> tuple[int, int, int]:
        c0, c1 = self.shard.columns
        return (self.target.layers, self.target.slices * self.max_rank, c1 - c0)

    @cached_property
    def b_shape(self) -> tuple[int, int, int]:
        return (self.target.layers, sum(self.widths), self.max_rank)

    @cached_property
    def widths(self) -> tuple[int, ...]:
        """Each slice's rows on this rank."""
        return self.shard.widths()

    @cached_property
    def b_offset(self) -> int:
        """Where b starts in the block, in elements."""
        return aligned(math.prod(self.a_shape) * self.dtype.itemsize) // self.dtype.itemsize

    @cached_property
    def numel(self) -> int:
        """The block's length in elements: a, the alignment gap, b."""
        return self.b_offset + math.prod(self.b_shape)

    @property
    def nbytes(self) -> int:
        """What the block takes in a buffer or a slab row, alignment included."""
        return aligned(self.numel * self.dtype.itemsize)

    @property
    def weight_bytes(self) -> int:
        """a's and b's bytes alone."""
        return (math.prod(self.a_shape) + math.prod(self.b_shape)) * self.dtype.itemsize

    def a_rows(self, s: int) -> slice:
        """Slice s's rows of a[layer]."""
        return slice(s * self.max_rank, (s + 1) * self.max_rank)

    @cached_property
    def _b_starts(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate(self.widths, initial=0))[:-1]

    def b_rows(self, s: int) -> slice:
        """Slice s's rows of b[layer]: this rank's rows of each slice, packed in slice order."""
        start = self._b_starts[s]
        return slice(start, start + self.widths[s])

    def split(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views a and b of a block whose last dimension is numel (a slab's leading slot dim is kept)."""
        lead = block.shape[:-1]
        a = block[..., : math.prod(self.a_shape)].view(*lead, *self.a_shape)
        b = block[..., self.b_offset : self.numel].view(*lead, *self.b_shape)
        return a, b


@dataclass(frozen=True, eq=False)
class SlotLayout:
    """Every target's layout of one node on one rank: what the host tier, the device pool and the op share."""

    spec: LoraSpec
    rank: int = 0
    world_size: int = 1
    dtype: torch.dtype = field(default_factory=bfloat16)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not one of world_size {self.world_size}")
        self.spec.check_world(self.world_size)

    @cached_property
    def targets(self) -> dict[str, TargetLayout]:
        R = self.spec.max_rank
        return {name: TargetLayout(t, R, t.shard(self.rank, self.world_size), self.dtype)
                for name, t in self.spec.targets.items()}

    def nbytes(self, names: Iterable[str]) -> int:
        """The bytes of a buffer holding these targets' blocks back to back."""
        return sum(self.targets[n].nbytes for n in names)

    def carve(self, buf: torch.Tensor, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Each named target's block, a typed flat view of the uint8 buf, back to back in the order given."""
        blocks, at = {}, 0
        for n in names:
            t = self.targets[n]
            blocks[n] = buf[at : at + t.numel * self.dtype.itemsize].view(self.dtype)
            at += t.nbytes
        return blocks

    def offsets(self, names: Iterable[str]) -> dict[str, int]:
        """Where each named target's block starts in such a buffer, in bytes."""
        out, at = {}, 0
        for n in names:
            out[n] = at
            at += self.targets[n].nbytes
        return out
