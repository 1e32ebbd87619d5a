"""An adapter copied into this rank's slot layout from any source, as its plan says.

The reads (preadv from a file, many tensors a call, no page faults on it; a copy from pushed tensors)
are shared in batches by this thread and the reader threads; two threads copy out of the
page cache about 1.15x faster than one here. Where fingerprints are given, each run is fingerprinted
where it landed before anything is laid out from it. Then the staged bytes move into their places:
padded, cut to a shard, cast, and scaled where a module's own scaling folds into its B.
"""

from __future__ import annotations

import bisect
import math
import os
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from . import fingerprint
from .copies import Piece, Read, StackedCopy, Staged
from .folds import FoldRow, Folds
from .header_json import no_collection
from .host_memory import HostBuffers
from .plan import Plan
from .source import Source, memory_at

READ_THREADS = min(4, os.cpu_count() or 1)
_READERS = ThreadPoolExecutor(max(READ_THREADS - 1, 1), thread_name_prefix="mstar-lora-read")

Views = dict[str, tuple[torch.Tensor, torch.Tensor]]  # target -> (a, b)


class Landing(NamedTuple):
    """Where a read's bytes land: the buffer's blocks (and their a / b views) and the staging buffer."""

    blocks: dict[str, torch.Tensor]
    views: Views
    memory: tuple[torch.Tensor, torch.Tensor]  # the blocks' bytes (from the skew on), the staging buffer


def read_layout(p: Plan, folds: Folds, source: Source, buffers: HostBuffers, staging: HostBuffers,
                expected: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """Each target's block for this rank, in one host buffer of the layout's size, read from source. With
    expected (each run's fingerprint, as fingerprints() took them), a run that lands other than it was is a
    ValueError."""
    landing = land(p, buffers, staging)
    if not source.unchanged():
        raise ValueError("the file changed size since its header was read")
    read(source, landed_runs(p, landing), expected)
    return lay_out(p, landing, folds)


def land(p: Plan, buffers: HostBuffers, staging: HostBuffers) -> Landing:
    """The buffers a read of p fills: a fresh one comes zeroed from the kernel, so padding and untouched
    layers cost nothing; a reused one is zeroed only where the pieces leave it. staging lends the buffer
    staged bytes pass through, which is unviewed again once the read is done."""
    layout = p.layout
    buf, fresh = buffers.take(p.nbytes)
    blocks = layout.carve(buf[p.skew :], p.targets)
    views = {name: layout.targets[name].split(block) for name, block in blocks.items()}
    if not fresh:
        _zero_padding(p, blocks, views, layout.spec.max_rank)
    stage = staging.take(p.staging, exact=False)[0] if p.staging else torch.empty(0, dtype=torch.uint8)
    return Landing(blocks, views, (buf[p.skew :], stage))


class Scatter:
    """Byte ranges of a source (start, length) and the memory each goes to: visit(offset, chunk) copies what
    of them a chunk of the source holds, so that a read can lay out the very bytes it hashes as they pass."""

    def __init__(self, ranges: Sequence[tuple[int, int, memoryview]]) -> None:
        self.ranges = sorted(ranges, key=lambda r: r[0])
        self.starts = [r[0] for r in self.ranges]
        self.longest = max((r[1] for r in self.ranges), default=0)

    def __call__(self, at: int, chunk: memoryview) -> None:
        end = at + len(chunk)
        i = bisect.bisect_left(self.starts, at - self.longest)
        while i < len(self.ranges) and self.starts[i] < end:
            start, n, dst = self.ranges[i]
            lo, hi = max(start, at), min(start + n, end)
            if lo < hi:
                dst[lo - start : hi - start] = chunk[lo - at : hi - at]
            i += 1


LandedRun = tuple[int, list[memoryview], int]  # a run's offset in the source, where its parts land, their total


def landed_runs(p: Plan, landing: Landing) -> list[list[LandedRun]]:
    """p's batches of runs, direct ones then staged (the order fingerprints are kept in), each part as the
    memory it lands in. Made with the collector held off: a view is an object it tracks, a per-expert adapter
    lands in 36,864 of them, and making them set off its full passes over the host's heap (8 ms held off,
    90-100 ms when a full pass came, in a process of 200,000 tracked objects); they hold no cycle and go
    with the read."""
    out = []
    with no_collection():
        for memory, batches in zip(landing.memory, (p.batches, p.staged_batches), strict=True):
            view = memory_at(memory.data_ptr(), memory.numel())
            out += [[(at, [view[to : to + n] for to, n in parts], total) for at, parts, total in b] for b in batches]
    return out


def landing_ranges(runs: list[list[LandedRun]]) -> list[tuple[int, int, memoryview]]:
    """Every part of runs, as (its offset in the source, its length, where it lands)."""
    out = []
    for batch in runs:
        for at, views, _ in batch:
            for v in views:
                out.append((at, len(v), v))
                at += len(v)
    return out


def fingerprints(runs: list[list[LandedRun]]) -> tuple[int, ...]:
    """Each run's fingerprint, from where it landed (before anything is laid out from it)."""
    return tuple(fingerprint.of_parts(views) for batch in runs for _, views, _ in batch)


def lay_out(p: Plan, landing: Landing, folds: Folds) -> dict[str, torch.Tensor]:
    """The staged bytes moved into their places (padded to max_rank, cut to a shard, cast, stacked experts
    spread), and each module's own scaling folded into its B, in float32 before the cast."""
    views, stage, ratios, R = landing.views, landing.memory[1], folds.ratios, p.layout.spec.max_rank
    for c in p.stacked_copies:
        _copy_stacked(views, c, typed(stage, c.A), typed(stage, c.B), ratios.get(c.module, 1.0), R)
    for q, whole in p.mapped_copies:
        _copy_piece(views, q, typed(stage, whole)[q.rows[0] : q.rows[1]])
    for d in p.dense:
        b = views[d.target][1]
        shape = (*b.shape[:-1], d.rank)
        _copy_rows(b[..., : d.rank], _typed_at(stage, d.at, math.prod(shape) * d.dtype.itemsize, d.dtype).view(shape))
    for r in p.spread_reads:
        _copy_piece(views, r.piece, _rows(stage, r))
    for r in p.spread_reads:
        if r.piece.role == "B" and r.piece.module in ratios:
            _fold(views, r.piece, _rows(stage, r), ratios[r.piece.module])
    _fold_rows(views, folds.staged_rows, stage)
    _fold_rows(views, folds.direct_rows)
    _fold_whole(views, folds.whole)
    return landing.blocks


def typed(buf: torch.Tensor, s: Staged) -> torch.Tensor:
    """A tensor staged whole, as a linear's [rows, columns], from its bytes in the uint8 buf."""
    return _typed_at(buf, s.at, s.nbytes, s.dtype).view(s.shape)


def _typed_at(buf: torch.Tensor, at: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """nbytes of buf from at as dtype: a view, or a copy where they do not lie at an address of the dtype's
    alignment (a file may place them so: a header whose length is no multiple of 4, say)."""
    raw = buf[at : at + nbytes]
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype)


def _fold_whole(views: Views, whole: dict[str, float]) -> None:
    """b scaled in float32 then cast, a layer at a time: exact, as b holds the file's values."""
    for target, ratio in whole.items():
        b = views[target][1]
        for layer in range(b.shape[0]):
            b[layer].copy_(b[layer].float() * ratio)


def _fold_rows(views: Views, rows: tuple[FoldRow, ...], stage: torch.Tensor | None = None) -> None:
    """A module's own scaling folded into the B reads the plan listed, in float32 before the cast: from the
    staged rows where stage is given, else from the exact copy in place."""
    for f in rows:
        dst = views[f.target][1][f.layer, f.b_to : f.b_to + f.height, : f.r]
        src = dst if stage is None else _typed_at(stage, f.at, f.nbytes, f.dtype).view(-1, f.r)
        dst.copy_(src.float() * f.ratio)


def _copy_stacked(views: Views, c: StackedCopy, A: torch.Tensor, B: torch.Tensor, ratio: float, R: int) -> None:
    """A stacked module's every expert into its slices, a few copies a layer (experts.py says how A and B
    hold the experts): each expert's A into the rows of each of its slices, its B's rows of each slice,
    this rank's shard of them, into that slice's rows of b."""
    count, per, r = c.count, c.per, c.r
    if c.a_in:
        down, up = A.reshape(count, r, c.fan_in), B.reshape(c.fan_out, r, count).permute(2, 0, 1)
    else:  # A on the output side: B's transpose is the input-side factor
        down, up = B.reshape(c.fan_in, r, count).permute(2, 1, 0), A.reshape(count, r, c.fan_out).transpose(1, 2)
    a, b = views[c.target]
    a = a[c.layer].view(count, per, R, a.shape[-1])
    b = b[c.layer].view(count, per, -1, R)
    (c0, c1), width = c.columns, c.width
    for j in range(per):
        a[:, j, :r].copy_(down[:, :, c0:c1])
        rows = up[:, j::per] if c.interleaved else up[:, j * width : (j + 1) * width]
        r0, r1 = c.rows[j]  # every expert's slice j shards alike
        b[:, j, :, :r].copy_(rows[:, r0:r1] if ratio == 1.0 else rows[:, r0:r1].float() * ratio)


def _zero_padding(p: Plan, blocks: dict[str, torch.Tensor], views: Views, R: int) -> None:
    """Zero what the pieces leave of a reused buffer: whole blocks they do not fill, and a dense
    target's rank padding."""
    for name in p.partial:
        blocks[name].zero_()
    for d in p.dense:
        a, b = views[d.target]
        a.view(a.shape[0], -1, R, a.shape[2])[:, :, d.rank :].zero_()
        b[..., d.rank :].zero_()


def _rows(stage: torch.Tensor, r: Read) -> torch.Tensor:
    """A staged read's rows of its factor, as a linear's."""
    return _typed_at(stage, r.to, r.nbytes, r.piece.entry.torch_dtype).view(-1, r.width)


def _destination(views: Views, q: Piece) -> torch.Tensor:
    a, b = views[q.target]
    return (a if q.role == "A" else b)[q.layer, q.to_rows[0] : q.to_rows[1], : q.columns[1] - q.columns[0]]


def _copy_piece(views: Views, q: Piece, rows: torch.Tensor) -> None:
    """q's columns of rows (its rows of the factor, as a linear's) into its place."""
    _copy_rows(_destination(views, q), rows[:, q.columns[0] : q.columns[1]])


def _fold(views: Views, q: Piece, rows: torch.Tensor | None, ratio: float) -> None:
    """q's B scaled by ratio in float32, then cast: from its staged rows, or from the exact copy in place."""
    dst = _destination(views, q)
    dst.copy_((dst if rows is None else rows).float() * ratio)


def _copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst = src, a row at a time as the widest integers the rows are made of where no cast is needed:
    a rank-4 bf16 row padded to 16 is one int64, which copies 3-5x faster than four bf16."""
    if src.dtype != dst.dtype or not src.is_contiguous():
        dst.copy_(src)
        return
    size = src.element_size()
    spans = [t.shape[-1] * size for t in (dst, src)] + [t.storage_offset() * size for t in (dst, src)]
    spans += [stride * size for t in (dst, src) for stride in t.stride()[:-1]]
    unit = next(u for u in (torch.int64, torch.int32, torch.int16, torch.uint8)
                if all(n % u.itemsize == 0 for n in spans))
    dst.view(unit).copy_(src.view(unit))


def read(source: Source, batches: list[list[LandedRun]], expected: Sequence[int] | None = None) -> None:
    """Every batch read from source into its memory by whichever of this thread and the reader threads is
    free; with expected, each run's fingerprint (in batch order) checked where the run landed."""
    queue: deque = deque()
    index = 0
    for b in batches:
        queue.append((index, b))
        index += len(b)
    helpers = [_READERS.submit(_drain, source, queue, expected) for _ in range(min(READ_THREADS - 1, len(queue)))]
    try:
        _drain(source, queue, expected)
    except BaseException:
        queue.clear()
        raise
    finally:  # every read is over before the memory can go
        for f in helpers:
            f.exception()
    for f in helpers:
        f.result()


def _drain(source: Source, queue: deque, expected: Sequence[int] | None) -> None:
    while True:
        try:
            first, runs = queue.popleft()
        except IndexError:
            return
        for i, (at, views, nbytes) in enumerate(runs, first):
            source.read_into(views, at, nbytes)
            if expected is not None and fingerprint.of_parts(views) != expected[i]:
                queue.clear()
                raise ValueError(f"the {nbytes} bytes at offset {at} differ from those that hashed "
                                 "to its digest")
