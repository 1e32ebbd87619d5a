"""An adapter's file copied into this rank's slot layout, as plan.py says.

The reads (preadv, many tensors a call, no page faults on the file) are shared in batches by this
thread and the reader threads; two threads copy out of the page cache about 1.15x faster than one
here, and the copies from the file's mapping go on beside them.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from .checkpoint import Checkpoint
from .experts import stacked_widths
from .host_memory import HostBuffers
from .keys import ConvertKeys
from .layout import SlotLayout
from .plan import Batch, Piece, Plan, Read, Stacked, plan
from .spec import as_linear

READ_THREADS = min(4, os.cpu_count() or 1)
_READERS = ThreadPoolExecutor(max(READ_THREADS - 1, 1), thread_name_prefix="mstar-lora-read")

Views = dict[str, tuple[torch.Tensor, torch.Tensor]]  # target -> (a, b)


def read_layout(ckpt: Checkpoint, layout: SlotLayout, buffers: HostBuffers, staging: HostBuffers,
                ) -> tuple[int, float, dict[str, torch.Tensor]]:
    """(largest rank served, the slots' scaling, each target's block) for this rank, in one host buffer of
    the layout's size.

    A fresh buffer comes zeroed from the kernel, so padding and untouched layers cost nothing; a
    reused one is zeroed only where the pieces leave it. staging lends the buffer staged bytes pass
    through, which is unviewed again once this returns.
    """
    p = plan(ckpt, layout)
    conv = layout.spec.convert_keys
    scalings = ckpt.scalings(conv)
    scaling = node_scaling(ckpt, p, conv)
    ratios = {m: scalings[m] / scaling for m in p.modules if scalings[m] != scaling}
    whole = _whole_folds(p, ratios)
    ratios = {m: r for m, t, _ in p.owners if (r := ratios.get(m)) is not None and t not in whole}
    buf, fresh = buffers.take(p.nbytes)
    blocks = layout.carve(buf[p.skew :], p.targets)
    views = {name: layout.targets[name].split(block) for name, block in blocks.items()}
    if not fresh:
        _zero_padding(p, blocks, views, layout.spec.max_rank)
    for st in p.stacked:
        _copy_stacked(layout, views, st, ckpt.tensor(st.A), ckpt.tensor(st.B), ratios.get(st.module, 1.0))
    if ckpt.tensors is not None:
        _copy_pushed(ckpt, p, buf[p.skew :], views, ratios)
        _fold_whole(views, whole)
        return p.rank, scaling, blocks
    stage = staging.take(p.staging)[0] if p.staging else torch.empty(0, dtype=torch.uint8)
    _read(ckpt, [(buf[p.skew :], p.batches), (stage, p.staged_batches)],
          lambda: [_copy_piece(views, q, ckpt.tensor(q.entry)[q.rows[0] : q.rows[1]]) for q in p.mapped])
    for d in p.dense:
        b = views[d.target][1]
        shape = (*b.shape[:-1], d.rank)
        _copy_rows(b[..., : d.rank], stage[d.at : d.at + math.prod(shape) * d.dtype.itemsize].view(d.dtype).view(shape))
    for r in p.spread():
        _copy_piece(views, r.piece, _rows(stage, r))
    for r in p.staged:  # a module's own scaling is folded into its B, in float32 before the cast
        if r.piece.role == "B" and r.piece.module in ratios:
            _fold(views, r.piece, _rows(stage, r), ratios[r.piece.module])
    _fold_direct(p, views, ratios)
    _fold_whole(views, whole)
    return p.rank, scaling, blocks


def node_scaling(ckpt: Checkpoint, p: Plan, conv: ConvertKeys) -> float:
    """The scaling a node's slots take: the one most of the modules it serves share, the adapter's own
    (its config's lora_alpha / r) where that is among the most; the rest fold into their B. An expert
    node of an adapter whose experts have a rank of their own thus folds nothing."""
    own, scalings = ckpt.scaling(conv), ckpt.scalings(conv)
    counts = Counter(scalings[m] for m in p.modules)
    return max(counts, key=lambda s: (counts[s], s == own, -s)) if counts else own


def _whole_folds(p: Plan, ratios: dict[str, float]) -> dict[str, float]:
    """Targets whose every module has one scaling of its own, copied exactly (in the store's dtype): their
    whole b is folded in place at once (a Qwen3-MoE adapter's experts at a rank of their own: 55,000
    folds become one a layer)."""
    seen: dict[str, set[tuple[float, bool]]] = {}
    for module, target, exact in p.owners:
        seen.setdefault(target, set()).add((ratios.get(module, 1.0), exact))
    whole = {}
    for target, kinds in seen.items():
        if len(kinds) == 1:
            ((ratio, exact),) = kinds
            if exact and ratio != 1.0:
                whole[target] = ratio
    return whole


def _fold_whole(views: Views, whole: dict[str, float]) -> None:
    """b scaled in float32 then cast, a layer at a time: exact, as b holds the file's values."""
    for target, ratio in whole.items():
        b = views[target][1]
        for layer in range(b.shape[0]):
            b[layer].copy_(b[layer].float() * ratio)


def _copy_pushed(ckpt: Checkpoint, p: Plan, blocks: torch.Tensor, views: Views, ratios: dict[str, float]) -> None:
    """Every piece copied from the pushed tensors, which are read and never written: the direct ones
    as bytes, half on a reader thread (two threads copy 1.45x faster than one here), the rest one by one."""
    flat: dict[int, torch.Tensor] = {}
    pairs = []
    for r in p.direct:
        e = r.piece.entry
        if e.start not in flat:
            flat[e.start] = ckpt.tensor(e).cpu().contiguous().reshape(-1).view(torch.uint8)
        pairs.append((blocks[r.to : r.to + r.nbytes], flat[e.start][r.at - e.start : r.at - e.start + r.nbytes]))
    half = len(pairs) // 2 if READ_THREADS > 1 else 0
    other = _READERS.submit(torch._foreach_copy_, *map(list, zip(*pairs[:half], strict=True))) if half else None
    try:
        for q in (*(r.piece for r in p.staged), *p.mapped):
            rows = ckpt.tensor(q.entry)[q.rows[0] : q.rows[1]]
            if q.role == "B" and q.module in ratios:
                _fold(views, q, rows, ratios[q.module])
            else:
                _copy_piece(views, q, rows)
        if pairs[half:]:
            torch._foreach_copy_(*map(list, zip(*pairs[half:], strict=True)))
    finally:
        if other is not None:
            other.result()
    _fold_direct(p, views, ratios)


def _fold_direct(p: Plan, views: Views, ratios: dict[str, float]) -> None:
    """A module's own scaling folded into the B its direct reads copied exactly, in float32 before the cast."""
    for r in p.direct:
        if r.piece.role == "B" and r.piece.module in ratios:
            _fold(views, r.piece, None, ratios[r.piece.module])


def _copy_stacked(layout: SlotLayout, views: Views, st: Stacked, A: torch.Tensor, B: torch.Tensor,
                  ratio: float) -> None:
    """A stacked module's every expert into its slices, a few copies a layer (experts.py says how A and B
    hold the experts): each expert's A into the rows of each of its slices, its B's rows of each slice,
    this rank's shard of them, into that slice's rows of b."""
    tl = layout.targets[st.target]
    t, R = tl.target, layout.spec.max_rank
    count, (fan_in, fan_out) = t.experts.count, stacked_widths(t)
    per, r = t.slices // count, st.rank(t)
    if st.orientation == "A in":
        down, up = A.reshape(count, r, fan_in), B.reshape(fan_out, r, count).permute(2, 0, 1)
    else:  # A on the output side: B's transpose is the input-side factor
        down, up = B.reshape(fan_in, r, count).permute(2, 1, 0), A.reshape(count, r, fan_out).transpose(1, 2)
    a, b = views[st.target]
    a = a[st.layer].view(count, per, R, a.shape[-1])
    b = b[st.layer].view(count, per, -1, R)
    (c0, c1), width = tl.shard.columns, t.out_features[0]
    for j in range(per):
        a[:, j, :r].copy_(down[:, :, c0:c1])
        rows = up[:, j::per] if t.experts.interleaved else up[:, j * width : (j + 1) * width]
        r0, r1 = tl.shard.rows[j]  # every expert's slice j shards alike
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
    e = r.piece.entry
    return stage[r.to : r.to + r.nbytes].view(e.torch_dtype).view(-1, as_linear(e.shape)[1])


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


def _read(ckpt: Checkpoint, work: list[tuple[torch.Tensor, tuple[Batch, ...]]], meanwhile: Callable[[], object],
          ) -> None:
    """Every batch read into its memory by whichever of this thread and the reader threads is free,
    this one doing meanwhile first."""
    queue: deque = deque()
    for memory, batches in work:
        # A plain view of the memory's bytes for preadv to fill; the tensor, which the caller holds, owns them.
        view = memoryview((ctypes.c_char * memory.numel()).from_address(memory.data_ptr())).cast("B")
        queue.extend([(at, [view[to : to + n] for to, n in parts]) for at, parts in b] for b in batches)
    fd = os.open(ckpt.weights, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size != ckpt.size:
            raise ckpt.refusal(["the file changed size since its header was read"])
        helpers = [_READERS.submit(_drain, ckpt, fd, queue) for _ in range(min(READ_THREADS - 1, len(queue)))]
        try:
            meanwhile()
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
        for at, views in runs:
            _preadv_all(ckpt, fd, views, at)


def _preadv_all(ckpt: Checkpoint, fd: int, views: list[memoryview], at: int) -> None:
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
