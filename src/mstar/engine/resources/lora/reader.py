"""An adapter's file copied into this rank's slot layout.

Most of an adapter's bytes are contiguous both in the file and in their place in the layout and
need no cast: every A whose columns are whole, and B where the module's rank is max_rank. Those
are read with preadv straight into the buffer, many tensors a call and no page faults on the
file. The rest (a row target's column shard, B's rows padded to max_rank, a dtype cast, a module's
own scaling folded into B) are torch copies out of a mapping of the file.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
from collections.abc import Iterator
from typing import NamedTuple

import torch

from .checkpoint import Checkpoint
from .host_memory import HostBuffers
from .layout import SlotLayout
from .safetensors_header import TensorEntry
from .spec import as_linear

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
RUN_BYTES = 1 << 30  # Linux moves at most about 2 GiB in one read


class Piece(NamedTuple):
    """One factor of one module for one slice of one layer, cut to this rank: rows and columns of
    the factor (as a linear's [rows, columns]) into rows of a[layer] or b[layer], columns 0 on."""

    module: str
    role: str  # "A" or "B"
    entry: TensorEntry
    rows: tuple[int, int]
    columns: tuple[int, int]
    target: str
    layer: int
    to_rows: tuple[int, int]
    direct: tuple[int, int, int] | None  # (file offset, bytes, buffer offset) where preadv can place it


class Plan(NamedTuple):
    """How one header's adapter is copied into one layout: the same for every file with that header."""

    targets: tuple[str, ...]  # in buffer order
    nbytes: int
    pieces: tuple[Piece, ...]
    partial: frozenset[str]  # targets whose blocks the pieces do not fill (a reused buffer zeroes them)
    rank: int  # the largest module rank among the pieces
    runs: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]  # preadv calls of the direct pieces


def plan(ckpt: Checkpoint, layout: SlotLayout) -> Plan:
    """The pieces of the modules layout's spec serves (the rest are other nodes'), once per header."""
    key = ("plan", layout)
    memo = ckpt.header.memo
    if key not in memo:
        memo[key] = _plan(ckpt, layout)
    return memo[key]


def _plan(ckpt: Checkpoint, layout: SlotLayout) -> Plan:
    spec, R, dtype = layout.spec, layout.spec.max_rank, layout.dtype
    item = dtype.itemsize
    placed = []
    for module, keys in sorted(ckpt.modules(spec.convert_keys).items()):
        loc = spec.locate(module)
        if loc is not None:
            placed.append((module, loc, keys.roles["A"], keys.roles["B"]))
    targets = tuple(n for n in spec.targets if any(loc.target == n for _, loc, _, _ in placed))
    offsets = layout.offsets(targets)
    pieces, filled = [], dict.fromkeys(targets, 0)
    for module, loc, A, B in placed:
        tl = layout.targets[loc.target]
        t = tl.target
        (r, a_cols), (c0, c1) = as_linear(A.shape), tl.shard.columns
        same = A.torch_dtype == dtype
        for s in t.covered(loc.slice):
            # The sharding rule: A's input columns are this rank's chunk (all of them unless row-parallel);
            # B's rows are this rank's rows of slice s, found at the slice's start in a module covering all.
            r0, r1 = tl.shard.rows[s]
            src = 0 if loc.slice is not None else t.slice_starts[s]
            a_to = tl.a_rows(s).start
            b_to = tl.b_rows(s).start
            a_at = offsets[loc.target] + (loc.layer * t.slices * R + a_to) * (c1 - c0) * item
            b_at = offsets[loc.target] + (tl.b_offset + (loc.layer * tl.b_shape[1] + b_to) * R) * item
            whole = (c0, c1) == (0, a_cols)
            pieces.append(Piece(module, "A", A, (0, r), (c0, c1), loc.target, loc.layer, (a_to, a_to + r),
                                (A.start, r * a_cols * item, a_at) if same and whole else None))
            b_direct = (B.start + (src + r0) * r * item, (r1 - r0) * r * item, b_at) if same and r == R else None
            pieces.append(Piece(module, "B", B, (src + r0, src + r1), (0, r), loc.target, loc.layer,
                                (b_to, b_to + r1 - r0), b_direct))
            filled[loc.target] += r * (c1 - c0) + (r1 - r0) * r
    partial = frozenset(n for n in targets if filled[n] < layout.targets[n].weight_bytes // item)
    rank = max((as_linear(A.shape)[0] for _, _, A, _ in placed), default=0)
    total = layout.nbytes(targets)
    return Plan(targets, total, tuple(pieces), partial, rank, tuple(_runs(p.direct for p in pieces if p.direct)))


def _runs(direct) -> Iterator[tuple[int, tuple[tuple[int, int], ...]]]:
    """Direct pieces in file order, joined into (file offset, ((buffer offset, bytes), ...)) calls
    wherever each starts where the last ended."""
    start = end = None
    parts: list[tuple[int, int]] = []
    for at, n, to in sorted(direct):
        if at != end or len(parts) == IOV_MAX or end - start + n > RUN_BYTES:
            if parts:
                yield start, tuple(parts)
            start, end, parts = at, at, []
        parts.append((to, n))
        end += n
    if parts:
        yield start, tuple(parts)


def read_layout(ckpt: Checkpoint, layout: SlotLayout, buffers: HostBuffers) -> tuple[int, dict[str, torch.Tensor]]:
    """(largest rank served, each target's block) for this rank, in one host buffer of the layout's size.

    A fresh buffer comes zeroed from the kernel, so padding and untouched layers cost nothing; a
    reused one is zeroed only in blocks the pieces do not fill.
    """
    p = plan(ckpt, layout)
    conv = layout.spec.convert_keys
    scaling, scalings = ckpt.scaling(conv), ckpt.scalings(conv)
    ratios = {m: scalings[m] / scaling for m in {piece.module for piece in p.pieces} if scalings[m] != scaling}
    buf, fresh = buffers.take(p.nbytes)
    blocks = layout.carve(buf, p.targets)
    if not fresh:
        for name in p.partial:
            blocks[name].zero_()
    runs, strided = p.runs, [q for q in p.pieces if q.direct is None]
    if ratios:  # a module with its own scaling has it folded into B, in float32, so not read directly
        def folded(q: Piece) -> bool:
            return q.role == "B" and q.module in ratios

        runs = tuple(_runs(q.direct for q in p.pieces if q.direct is not None and not folded(q)))
        strided += [q for q in p.pieces if q.direct is not None and folded(q)]
    if runs:
        _read_direct(ckpt, runs, buf)
    if strided:
        _copy_strided(ckpt, layout, strided, blocks, ratios)
    return p.rank, blocks


def _read_direct(ckpt: Checkpoint, runs, buf: torch.Tensor) -> None:
    memory = memoryview((ctypes.c_char * buf.numel()).from_address(buf.data_ptr())).cast("B")
    fd = os.open(ckpt.weights, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size != ckpt.size:
            raise ckpt.refusal(["the file changed size since its header was read"])
        for at, parts in runs:
            _preadv_all(ckpt, fd, [memory[to : to + n] for to, n in parts], at)
    finally:
        os.close(fd)
        memory.release()


def _preadv_all(ckpt: Checkpoint, fd: int, views: list[memoryview], at: int) -> None:
    i = 0
    while i < len(views):
        got = os.preadv(fd, views[i:], at)
        if got == 0:
            raise ckpt.refusal(["the file ended early: it changed since its header was read"])
        at += got
        while i < len(views) and got >= len(views[i]):
            got -= len(views[i])
            i += 1
        if got:
            views[i] = views[i][got:]


def _copy_strided(ckpt: Checkpoint, layout: SlotLayout, pieces: list[Piece], blocks: dict[str, torch.Tensor],
                  ratios: dict[str, float]) -> None:
    mm = ckpt.mapping()
    split = {name: layout.targets[name].split(block) for name, block in blocks.items()}
    for q in pieces:
        src = tensor_at(mm, q.entry)[q.rows[0] : q.rows[1], q.columns[0] : q.columns[1]]
        a, b = split[q.target]
        dst = (a if q.role == "A" else b)[q.layer, q.to_rows[0] : q.to_rows[1], : src.shape[1]]
        ratio = ratios.get(q.module, 1.0) if q.role == "B" else 1.0
        dst.copy_(src if ratio == 1.0 else src.float() * ratio)  # a module's own scaling, in float32 before the cast


def tensor_at(mm: mmap.mmap, e: TensorEntry) -> torch.Tensor:
    """The tensor e describes as a linear's [rows, columns], a view of the mapped file (read when used)."""
    count = math.prod(e.shape)
    return torch.frombuffer(mm, dtype=e.torch_dtype, count=count, offset=e.start).view(as_linear(e.shape))
