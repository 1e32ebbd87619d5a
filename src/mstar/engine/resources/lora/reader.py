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
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from .checkpoint import Checkpoint
from .experts import stacked_widths
from .host_memory import HostBuffers
from .layout import SlotLayout
from .plan import BATCH_BYTES, Batch, Piece, Plan, Read, Stacked, plan
from .safetensors_header import TensorEntry
from .source import FileSource
from .spec import as_linear

READ_THREADS = min(4, os.cpu_count() or 1)
_READERS = ThreadPoolExecutor(max(READ_THREADS - 1, 1), thread_name_prefix="mstar-lora-read")

Views = dict[str, tuple[torch.Tensor, torch.Tensor]]  # target -> (a, b)


def read_layout(ckpt: Checkpoint, layout: SlotLayout, buffers: HostBuffers, staging: HostBuffers,
                snapshot: torch.Tensor | None = None) -> tuple[int, float, dict[str, torch.Tensor]]:
    """(largest rank served, the slots' scaling, each target's block) for this rank, in one host buffer of
    the layout's size: copied out of snapshot (every byte of the checkpoint, as snapshot() takes it) or the
    pushed tensors where there are they, else read from the checkpoint's open file.

    A fresh buffer comes zeroed from the kernel, so padding and untouched layers cost nothing; a
    reused one is zeroed only where the pieces leave it. staging lends the buffer staged bytes pass
    through, which is unviewed again once this returns.
    """
    p = plan(ckpt, layout)
    scalings = ckpt.scalings(layout.spec.convert_keys)
    scaling = node_scaling(scalings, p.modules)
    ratios = {m: scalings[m] / scaling for m in p.modules if scalings[m] != scaling}
    whole = _whole_folds(p, ratios)
    ratios = {m: r for m, t, _ in p.owners if (r := ratios.get(m)) is not None and t not in whole}
    buf, fresh = buffers.take(p.nbytes)
    blocks = layout.carve(buf[p.skew :], p.targets)
    views = {name: layout.targets[name].split(block) for name, block in blocks.items()}
    if not fresh:
        _zero_padding(p, blocks, views, layout.spec.max_rank)
    if snapshot is not None or ckpt.tensors is not None:
        tensor_of = ckpt.tensor if snapshot is None else lambda e: typed(snapshot, e.start, e)
        for st in p.stacked:
            _copy_stacked(layout, views, st, tensor_of(st.A), tensor_of(st.B), ratios.get(st.module, 1.0))
        _copy_memory(tensor_of, p, buf[p.skew :], views, ratios)
        _fold_whole(views, whole)
        return p.rank, scaling, blocks
    stage = staging.take(p.staging)[0] if p.staging else torch.empty(0, dtype=torch.uint8)
    _read(ckpt, [(buf[p.skew :], p.batches), (stage, p.staged_batches)])
    at = p.staged_at()
    for st in p.stacked:
        _copy_stacked(layout, views, st, typed(stage, at[st.A.start], st.A), typed(stage, at[st.B.start], st.B),
                      ratios.get(st.module, 1.0))
    for q in p.mapped:
        _copy_piece(views, q, typed(stage, at[q.entry.start], q.entry)[q.rows[0] : q.rows[1]])
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


def snapshot(ckpt: Checkpoint, staging: HostBuffers) -> torch.Tensor:
    """Every byte of the checkpoint, once, at the header's offsets: read from its one open file (header
    included, which must be the one parsed), or copied from the pushed tensors. A read with a digest
    hashes this very copy and lays the adapter out from it, so what it serves is what hashed."""
    buf = staging.take(ckpt.size, exact=False)[0][: ckpt.size]
    if ckpt.tensors is not None:
        entries = list(ckpt.header.tensors.values())
        dst = [typed(buf, e.start, e, aligned_only=True) for e in entries]
        src = [ckpt.tensor(e) for e in entries]
        for d, t in zip(dst, src, strict=True):
            d.copy_(t)  # a copy of the values, not of the memory: a negative or conjugate view comes out resolved
        return buf
    runs = [(at, ((at, min(BATCH_BYTES, ckpt.size - at)),)) for at in range(0, ckpt.size, BATCH_BYTES)]
    _read(ckpt, [(buf, tuple((run,) for run in runs))])
    if bytes(buf[: len(ckpt.header.prefix)].numpy()) != ckpt.header.prefix:
        raise ckpt.refusal(["its header changed since it was read: the file was rewritten in place"])
    return buf


def typed(buf: torch.Tensor, at: int, e: TensorEntry, aligned_only: bool = False) -> torch.Tensor:
    """e's tensor as a linear's [rows, columns], from its bytes at offset at of the uint8 buf: a view, or a
    copy where the bytes do not lie at an address of their dtype's alignment (a file may place them so)."""
    raw = buf[at : at + e.nbytes]
    if raw.data_ptr() % e.torch_dtype.itemsize:
        if aligned_only:
            raise ValueError(f"a tensor at offset {at} is not aligned for {e.dtype}")
        raw = raw.clone()
    return raw.view(e.torch_dtype).view(as_linear(e.shape))


def node_scaling(scalings: Mapping[str, float], modules: Iterable[str]) -> float:
    """The scaling a node's slots take: the one most of the modules it serves share (the smaller where
    two are as common), never 0 while one is not; the rest fold into their B. It follows from the
    modules' scalings alone, which the digest covers, so one digest is always one layout. An expert
    node of an adapter whose experts have a rank of their own thus folds nothing."""
    counts = Counter(scalings[m] for m in modules)
    nonzero = {s: n for s, n in counts.items() if s}
    if not nonzero:
        return 0.0 if counts else 1.0  # every module serves nothing, or there are none
    return max(nonzero, key=lambda s: (nonzero[s], -s))


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


def _copy_memory(tensor_of: Callable[[TensorEntry], torch.Tensor], p: Plan, blocks: torch.Tensor, views: Views,
                 ratios: dict[str, float]) -> None:
    """Every piece copied from tensors in memory (pushed ones, read and never written, or a snapshot's):
    the direct ones as bytes, half on a reader thread (two threads copy 1.45x faster than one here), the
    rest one by one."""
    flat: dict[int, torch.Tensor] = {}
    pairs = []
    for r in p.direct:
        e = r.piece.entry
        if e.start not in flat:
            flat[e.start] = tensor_of(e).cpu().contiguous().reshape(-1).view(torch.uint8)
        pairs.append((blocks[r.to : r.to + r.nbytes], flat[e.start][r.at - e.start : r.at - e.start + r.nbytes]))
    half = len(pairs) // 2 if READ_THREADS > 1 else 0
    other = _READERS.submit(torch._foreach_copy_, *map(list, zip(*pairs[:half], strict=True))) if half else None
    try:
        for q in (*(r.piece for r in p.staged), *p.mapped):
            rows = tensor_of(q.entry)[q.rows[0] : q.rows[1]]
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


def _read(ckpt: Checkpoint, work: list[tuple[torch.Tensor, tuple[Batch, ...]]]) -> None:
    """Every batch read from the checkpoint's open file into its memory by whichever of this thread and
    the reader threads is free."""
    queue: deque = deque()
    for memory, batches in work:
        # A plain view of the memory's bytes for preadv to fill; the tensor, which the caller holds, owns them.
        view = memoryview((ctypes.c_char * memory.numel()).from_address(memory.data_ptr())).cast("B")
        queue.extend([(at, [view[to : to + n] for to, n in parts]) for at, parts in b] for b in batches)
    source = ckpt.source
    if not source.unchanged():
        raise ckpt.refusal(["the file changed size since its header was read"])
    helpers = [_READERS.submit(_drain, source, queue) for _ in range(min(READ_THREADS - 1, len(queue)))]
    try:
        _drain(source, queue)
    except ValueError as e:
        queue.clear()
        raise ckpt.refusal([str(e)]) from None
    finally:  # every read is over before the memory can go
        for f in helpers:
            f.exception()
    for f in helpers:
        try:
            f.result()
        except ValueError as e:
            raise ckpt.refusal([str(e)]) from None


def _drain(source: FileSource, queue: deque) -> None:
    while True:
        try:
            runs = queue.popleft()
        except IndexError:
            return
        for at, views in runs:
            source.read_into(views, at)
