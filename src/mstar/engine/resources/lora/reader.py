"""An adapter's file copied into this rank's slot layout.

Most of an adapter's bytes are contiguous both in the file and in their place in the layout and
need no cast: every A whose columns are whole, and B where the module's rank is max_rank. Those
are read with preadv straight into the buffer, many tensors a call and no page faults on the file,
on up to READ_THREADS threads. The rest (a row target's column shard, B's rows padded to max_rank,
a dtype cast, a module's own scaling folded into B) are torch copies out of a mapping of the file.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from .checkpoint import Checkpoint
from .host_memory import HostBuffers
from .layout import SlotLayout
from .safetensors_header import TensorEntry
from .spec import as_linear

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
RUN_BYTES = 1 << 30  # Linux moves at most about 2 GiB in one read
# Two threads copy out of the page cache about 1.15x faster than one (measured here), and the
# strided copies go on beside the reads. The direct pieces are read in batches of about BATCH_BYTES,
# each taken by whichever thread is free.
READ_THREADS = min(4, os.cpu_count() or 1)
BATCH_BYTES = 4 << 20
# The kernel copies a file's bytes out at memory speed only where source and destination agree in
# their address modulo this (measured: 1.5x slower 16 bytes apart, 4x slower 8 apart), and a file's
# tensors start wherever its header ends. So the blocks start this far into their buffer, at the
# offset that makes most bytes agree.
SKEW = 64

_READERS = ThreadPoolExecutor(max(READ_THREADS - 1, 1), thread_name_prefix="mstar-lora-read")


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


class Direct(NamedTuple):
    """A piece preadv places: its bytes in the file and where they go, counted from the first block."""

    at: int
    nbytes: int
    to: int
    piece: Piece


Run = tuple[int, tuple[tuple[int, int], ...]]  # one preadv: file offset, ((offset from the first block, bytes), ...)
Batch = tuple[Run, ...]  # the runs one thread reads


class Plan(NamedTuple):
    """How one header's adapter is copied into one layout: the same for every file with that header."""

    targets: tuple[str, ...]  # in buffer order
    nbytes: int  # the buffer's: the blocks, from skew on
    skew: int
    direct: tuple[Direct, ...]
    strided: tuple[Piece, ...]
    batches: tuple[Batch, ...]  # the direct pieces, in batches for whichever thread is free
    partial: frozenset[str]  # targets whose blocks the pieces do not fill (a reused buffer zeroes them)
    rank: int  # the largest module rank among the pieces
    modules: tuple[str, ...]


def plan(ckpt: Checkpoint, layout: SlotLayout) -> Plan:
    """The pieces of the modules layout's spec serves (the rest are other nodes'), once per header."""
    key = ("plan", layout)
    memo = ckpt.header.memo
    if key not in memo:
        memo[key] = _plan(ckpt, layout)
    return memo[key]


class _Slice(NamedTuple):
    """What every module on one slice of one target shares, worked out once per plan."""

    columns: tuple[int, int]  # A's input columns on this rank
    rows: tuple[int, int]  # this rank's rows of the slice's B
    a_to: int  # the slice's first row in a[layer]
    b_to: int  # its first row in b[layer]
    a_layer: int  # elements of a[layer], of b[layer]
    b_layer: int
    b_at: int  # where b starts in the block, in elements


def _plan(ckpt: Checkpoint, layout: SlotLayout) -> Plan:
    spec, R, item = layout.spec, layout.spec.max_rank, layout.dtype.itemsize
    placed = []
    for module, keys in sorted(ckpt.modules(spec.convert_keys).items()):
        loc = spec.locate(module)
        if loc is not None:
            placed.append((module, loc, keys.roles["A"], keys.roles["B"]))
    targets = tuple(n for n in spec.targets if any(loc.target == n for _, loc, _, _ in placed))
    offsets = layout.offsets(targets)
    slices = {}
    for name in targets:
        tl = layout.targets[name]
        for s in range(tl.target.slices):
            slices[name, s] = _Slice(tl.shard.columns, tl.shard.rows[s], tl.a_rows(s).start, tl.b_rows(s).start,
                                     tl.a_shape[1] * tl.a_shape[2], tl.b_shape[1] * R, tl.b_offset)
    direct, strided, filled = [], [], dict.fromkeys(targets, 0)
    for module, (target, layer, s_), A, B in placed:
        t = spec.targets[target]
        r, a_cols = as_linear(A.shape)
        same, base = A.torch_dtype == layout.dtype, offsets[target] // item
        for s in t.covered(s_):
            # The sharding rule: A's input columns are this rank's chunk (all of them unless row-parallel);
            # B's rows are this rank's rows of slice s, found at the slice's start in a module covering all.
            sl = slices[target, s]
            (c0, c1), (r0, r1) = sl.columns, sl.rows
            src = 0 if s_ is not None else t.slice_starts[s]
            a = Piece(module, "A", A, (0, r), (c0, c1), target, layer, (sl.a_to, sl.a_to + r))
            b = Piece(module, "B", B, (src + r0, src + r1), (0, r), target, layer, (sl.b_to, sl.b_to + r1 - r0))
            if same and (c0, c1) == (0, a_cols):
                at = (base + layer * sl.a_layer + sl.a_to * a_cols) * item
                direct.append(Direct(A.start, r * a_cols * item, at, a))
            else:
                strided.append(a)
            if same and r == R:
                at = (base + sl.b_at + layer * sl.b_layer + sl.b_to * R) * item
                direct.append(Direct(B.start + (src + r0) * r * item, (r1 - r0) * r * item, at, b))
            else:
                strided.append(b)
            filled[target] += r * (c1 - c0) + (r1 - r0) * r
    partial = frozenset(n for n in targets if filled[n] < layout.targets[n].weight_bytes // item)
    rank = max((as_linear(A.shape)[0] for _, _, A, _ in placed), default=0)
    return Plan(targets, SKEW + layout.nbytes(targets), _skew(direct, item), tuple(direct), tuple(strided),
                _batches(direct), partial, rank, tuple(module for module, _, _, _ in placed))


def _skew(direct: list[Direct], itemsize: int) -> int:
    """The offset of the blocks in their buffer that puts most direct bytes at the address the file
    has them at, modulo SKEW; a whole number of elements, so every view stays aligned for its dtype."""
    weight: Counter[int] = Counter()
    for d in direct:
        weight[(d.at - d.to) % SKEW] += d.nbytes
    fits = [(n, -k) for k, n in weight.items() if k % itemsize == 0]
    return -max(fits)[1] if fits else 0


def _batches(direct: list[Direct]) -> tuple[Batch, ...]:
    """The direct pieces in file order, joined into one preadv wherever each starts where the last
    ended, in batches of about BATCH_BYTES."""
    share = BATCH_BYTES
    batches: list[list[Run]] = [[]]
    start = end = 0
    parts: list[tuple[int, int]] = []
    done = 0  # bytes of the finished batches and the current one
    for at, n, to, _ in sorted(direct):
        full = done >= share * len(batches)
        if at != end or len(parts) == IOV_MAX or end - start + n > RUN_BYTES or full:
            if parts:
                batches[-1].append((start, tuple(parts)))
            if full:
                batches.append([])
            start, end, parts = at, at, []
        parts.append((to, n))
        end += n
        done += n
    if parts:
        batches[-1].append((start, tuple(parts)))
    return tuple(tuple(b) for b in batches if b)


def read_layout(ckpt: Checkpoint, layout: SlotLayout, buffers: HostBuffers) -> tuple[int, dict[str, torch.Tensor]]:
    """(largest rank served, each target's block) for this rank, in one host buffer of the layout's size.

    A fresh buffer comes zeroed from the kernel, so padding and untouched layers cost nothing; a
    reused one is zeroed only in blocks the pieces do not fill.
    """
    p = plan(ckpt, layout)
    conv = layout.spec.convert_keys
    scaling, scalings = ckpt.scaling(conv), ckpt.scalings(conv)
    ratios = {m: scalings[m] / scaling for m in p.modules if scalings[m] != scaling}
    buf, fresh = buffers.take(p.nbytes)
    blocks = layout.carve(buf[p.skew :], p.targets)
    if not fresh:
        for name in p.partial:
            blocks[name].zero_()
    batches, strided = p.batches, list(p.strided)
    if ratios:  # a module with its own scaling has it folded into B, in float32, so not read directly
        def folded(d: Direct) -> bool:
            return d.piece.role == "B" and d.piece.module in ratios

        batches = _batches([d for d in p.direct if not folded(d)])
        strided += [d.piece for d in p.direct if folded(d)]
    copy_strided = (lambda: _copy_strided(ckpt, layout, strided, blocks, ratios)) if strided else None
    _copy(ckpt, batches, buf[p.skew :], copy_strided)
    return p.rank, blocks


def _copy(ckpt: Checkpoint, batches: tuple[Batch, ...], blocks: torch.Tensor,
          strided: Callable[[], None] | None) -> None:
    """The direct batches read by whichever of this thread and the reader threads is free, this one
    making the strided copies first."""
    # A plain view of the blocks' bytes for preadv to fill; the tensor, which the caller holds, owns them.
    memory = memoryview((ctypes.c_char * blocks.numel()).from_address(blocks.data_ptr())).cast("B")
    queue = deque([(at, [memory[to : to + n] for to, n in parts]) for at, parts in b] for b in batches)
    fd = os.open(ckpt.weights, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size != ckpt.size:
            raise ckpt.refusal(["the file changed size since its header was read"])
        helpers = [_READERS.submit(_drain, ckpt, fd, queue) for _ in range(min(READ_THREADS - 1, len(queue)))]
        try:
            if strided is not None:
                strided()
            _drain(ckpt, fd, queue)
        finally:  # every read is over before the descriptor goes
            for f in helpers:
                f.exception()
        for f in helpers:
            f.result()
    finally:
        os.close(fd)


def _drain(ckpt: Checkpoint, fd: int, queue: deque) -> None:
    while True:
        try:
            runs = queue.popleft()
        except IndexError:
            return
        _read_runs(ckpt, fd, runs)


def _read_runs(ckpt: Checkpoint, fd: int, runs: list[tuple[int, list[memoryview]]]) -> None:
    for at, views in runs:
        left = sum(len(v) for v in views)
        while left:
            got = os.preadv(fd, views, at)
            if got == 0:
                raise ckpt.refusal(["the file ended early: it changed since its header was read"])
            at, left = at + got, left - got
            while views and got >= len(views[0]):  # a short read (a signal, a huge run): on from where it stopped
                got -= len(views.pop(0))
            if got:
                views[0] = views[0][got:]


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
    count = 1
    for d in e.shape:
        count *= d
    return torch.frombuffer(mm, dtype=e.torch_dtype, count=count, offset=e.start).view(as_linear(e.shape))
