"""An adapter's weights copied from a memory map into this rank's slot layout.

With R = max_rank, module (layer l, slice s, rank r) fills a[t][l, s*R : s*R + r] with its A
(this rank's input columns for a row target) and, in b[t][l], the rows of slice s that this
rank holds, columns 0 : r, with its B. Everything else is zero.
"""

from __future__ import annotations

import mmap
from typing import NamedTuple

import torch

from .check import as_linear
from .checkpoint import Checkpoint
from .host_memory import HostBuffers, buffer_bytes, carve
from .safetensors_header import TensorEntry
from .spec import LoraSpec, LoraTarget

Placed = tuple[int, "int | None", str, TensorEntry, TensorEntry]  # layer, slice, module, A, B


def place(ckpt: Checkpoint, spec: LoraSpec) -> dict[str, list[Placed]]:
    """The modules spec serves, by target; modules it does not map are other nodes'."""
    placed: dict[str, list[Placed]] = {}
    for module, roles in sorted(ckpt.modules(spec.convert_keys).items()):
        loc = spec.locate(module)
        if loc is not None:
            target, layer, s = loc
            placed.setdefault(target, []).append((layer, s, module, roles["A"], roles["B"]))
    return placed


def tensor_at(mm: mmap.mmap, e: TensorEntry) -> torch.Tensor:
    """The tensor e describes, as a view of the mapped file (no bytes read until used)."""
    n = 1
    for d in e.shape:
        n *= d
    return torch.frombuffer(mm, dtype=e.torch_dtype, count=n, offset=e.start).view(as_linear(e.shape))


def read_layout(
    ckpt: Checkpoint, spec: LoraSpec, mm: mmap.mmap, rank: int, world_size: int, dtype: torch.dtype,
    buffers: HostBuffers,
) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(largest rank served, a, b) for this rank, in one host buffer of exactly the layout's size.

    A fresh buffer comes zeroed from the kernel, so padding and untouched layers cost nothing; a
    reused one is zeroed only where the pieces do not cover every byte.
    """
    placed = place(ckpt, spec)
    R = spec.max_rank
    shapes = []
    for name in placed:
        t = spec.targets[name]
        shapes += [t.a_shape(R, world_size), t.b_shape(R, world_size)]
    buf, fresh = buffers.take(buffer_bytes(shapes, dtype))
    views = carve(buf, shapes, dtype)
    a = dict(zip(placed, views[0::2], strict=True))
    b = dict(zip(placed, views[1::2], strict=True))
    top, scaling = 0, ckpt.scaling(spec.convert_keys)
    scalings = ckpt.scalings(spec.convert_keys)
    for name, modules in placed.items():
        t = spec.targets[name]
        shard = Shard.of(t, rank, world_size)
        pieces = [
            piece
            for layer, s, module, ea, eb in modules
            for piece in shard_pieces(t, shard, layer, s, tensor_at(mm, ea), tensor_at(mm, eb),
                                      scalings[module] / scaling)
        ]
        top = max([top] + [p.r for p in pieces])
        write_pieces(t, a[name], b[name], pieces, R, t.out_shards(world_size), fresh)
    return top, a, b


def _slices(t: LoraTarget, s: int | None) -> range:
    return range(t.slices) if s is None else range(s, s + 1)


class Piece(NamedTuple):
    """One module's factors for one slice of one layer, already cut to this rank's shard."""

    layer: int
    slice: int
    r: int
    a: torch.Tensor  # [r, in_shard]
    b: torch.Tensor  # [this rank's rows of the slice, r]
    ratio: float


class Shard(NamedTuple):
    """This rank's part of a target: A's input columns, and per slice the rows of B it keeps and
    where that slice starts in a module covering every slice."""

    columns: tuple[int, int]
    rows: tuple[tuple[int, int], ...]
    starts: tuple[int, ...]

    @staticmethod
    def of(t: LoraTarget, rank: int, world_size: int) -> Shard:
        starts = tuple(sum(t.out_features[:s]) for s in range(t.slices))
        rows = tuple(t.b_rows(s, rank, world_size) for s in range(t.slices))
        return Shard(t.a_columns(rank, world_size), rows, starts)


def shard_pieces(
    t: LoraTarget, shard: Shard, layer: int, s: int | None, A: torch.Tensor, B: torch.Tensor, ratio: float
) -> list[Piece]:
    """The sharding rule, for one module: a row target splits A's input columns and keeps B whole;
    a column target keeps A whole and gives each slice's B rows to ranks by heads (or rows); a
    module covering every slice (s None) gives each slice its A and its rows of B."""
    c0, c1 = shard.columns
    a = A if (c0, c1) == (0, A.shape[1]) else A[:, c0:c1]
    pieces = []
    for sl in _slices(t, s):
        r0, r1 = shard.rows[sl]
        src0 = 0 if s is not None else shard.starts[sl]
        b = B if (src0 + r0, src0 + r1) == (0, B.shape[0]) else B[src0 + r0 : src0 + r1]
        pieces.append(Piece(layer, sl, A.shape[0], a, b, ratio))
    return pieces


def write_pieces(
    t: LoraTarget, a: torch.Tensor, b: torch.Tensor, pieces: list[Piece], R: int, out_shards: tuple[int, ...],
    zeroed: bool,
) -> None:
    """Pieces into a [layers, slices*R, in_shard] and b [layers, out_shard, R].

    Piece (l, s, r) fills a[l, s*R : s*R + r] and, in b[l], slice s's rows, columns 0 : r. When the
    pieces cover every layer and slice at full rank with no scaling to fold, the layout is their
    concatenation in (layer, slice) order: one copy per factor instead of one per module.
    """
    S = t.slices
    dense = (len(pieces) == t.layers * S and all(p.r == R and p.ratio == 1.0 for p in pieces)
             and len({(p.layer, p.slice) for p in pieces}) == len(pieces))
    if dense:
        pieces = sorted(pieces, key=lambda p: (p.layer, p.slice))
        torch.cat([p.a for p in pieces], 0, out=a.view(-1, a.shape[-1]))
        torch.cat([p.b for p in pieces], 0, out=b.view(-1, R))
        return
    if not zeroed:
        a.zero_()
        b.zero_()
    starts = [sum(out_shards[:sl]) for sl in range(S)]
    for p in pieces:
        a[p.layer, p.slice * R : p.slice * R + p.r].copy_(p.a)
        rows = slice(starts[p.slice], starts[p.slice] + p.b.shape[0])
        # the module's own scaling, folded in float32 before the cast
        b[p.layer, rows, : p.r].copy_(p.b if p.ratio == 1.0 else p.b.float() * p.ratio)
