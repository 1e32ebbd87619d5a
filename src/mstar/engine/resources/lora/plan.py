"""How an adapter's file is copied into one rank's slot layout, worked out once per header.

A piece is one factor of one module for one slice of one layer, cut to the rank by the sharding
rule. Pieces contiguous both in the file and in their place, needing no cast, are read straight
into the blocks ("direct": every A whose columns are whole, and B where the module's rank is
max_rank). The rest of B is read into a staging buffer; where every layer and slice of a target
has one module of one rank ("dense", as in most adapters), its B lies there as [layers, out_shard,
r] and moves into b[..., :r] in one strided copy, else piece by piece. A row target's column shard
of A (a strided eighth of each row at world size 8) and stacked experts' factors are copied out of
their whole tensors, read into the staging buffer too: nothing is read through a mapping, which a
file cut meanwhile would turn into a SIGBUS.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

from .checkpoint import Checkpoint
from .experts import checkpoint_orientations
from .layout import SlotLayout, TargetLayout
from .safetensors_header import TensorEntry, torch_dtypes
from .spec import LoraSpec, LoraTarget, as_linear

if TYPE_CHECKING:
    import torch

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
RUN_BYTES = 1 << 30  # Linux moves at most about 2 GiB in one read
BATCH_BYTES = 4 << 20  # reads are shared among threads in batches of about this
# The kernel copies a file's bytes out at memory speed only where source and destination agree in
# their address modulo this (measured: 1.5x slower 16 bytes apart, 4x slower 8 apart), and a file's
# tensors start wherever its header ends. So the blocks start this far into their buffer, at the
# offset that makes most bytes agree, and staged bytes are placed to agree too.
SKEW = 64


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


class Read(NamedTuple):
    """A piece's rows, contiguous in the file, and where preadv puts them: in the blocks (counted from
    the first) or in the staging buffer."""

    at: int
    nbytes: int
    to: int
    piece: Piece | None  # None for a tensor staged whole


class Dense(NamedTuple):
    """A target whose B lies in the staging buffer as [layers, out_shard, rank], file dtype, from at."""

    target: str
    rank: int
    at: int
    dtype: torch.dtype


class Stacked(NamedTuple):
    """A module holding every expert's factors of one layer (experts.py), and which side of each expert A is on."""

    module: str
    A: TensorEntry
    B: TensorEntry
    target: str
    layer: int
    orientation: str

    def rank(self, t: LoraTarget) -> int:
        return self.A.shape[0] // t.experts.count


Run = tuple[int, tuple[tuple[int, int], ...]]  # one preadv: file offset, ((destination offset, bytes), ...)
Batch = tuple[Run, ...]  # runs read one after another by one thread


@dataclass(frozen=True, eq=False)
class Plan:
    """How one header's adapter is copied into one layout: the same for every file with that header, and
    all a read needs to know, so that it follows the plan over any source without asking the checkpoint."""

    layout: SlotLayout
    targets: tuple[str, ...]  # in buffer order
    nbytes: int  # the buffer's: the blocks, from skew on
    skew: int
    direct: tuple[Read, ...]
    staged: tuple[Read, ...]  # every read into the staging buffer
    dense: tuple[Dense, ...]
    mapped: tuple[Piece, ...]
    batches: tuple[Batch, ...]  # direct reads
    staged_batches: tuple[Batch, ...]
    staging: int  # the staging buffer's bytes
    partial: frozenset[str]  # targets, not dense, whose blocks the pieces do not fill
    rank: int  # the largest module rank among the pieces
    modules: tuple[str, ...]
    stacked: tuple[Stacked, ...] = ()  # every expert's factors in one pair, copied a layer at a time
    owners: tuple[tuple[str, str, bool], ...] = ()  # (module, its target, whether it is in the store's dtype)
    whole: tuple[tuple[TensorEntry, int], ...] = ()  # tensors staged whole (mapped pieces', stacked ones'), and where
    _folds: dict = field(default_factory=dict, repr=False)

    def staged_at(self) -> dict[int, int]:
        """Where each tensor staged whole lies in the staging buffer, by its start in the file."""
        return {e.start: at for e, at in self.whole}

    def spread(self) -> list[Read]:
        """The staged reads copied piece by piece: all but the B of dense targets."""
        dense = {d.target for d in self.dense}
        return [r for r in self.staged if r.piece.role == "A" or r.piece.target not in dense]

    @cached_property
    def ranks(self) -> dict[str, torch.Tensor]:
        """target -> [layers, slices] int32: each served module's real rank (0 where there is none), which
        the device pool keeps beside its slot so the kernels multiply ranks, not max_rank. Read-only:
        adapters of one recipe share it."""
        R = self.layout.spec.max_rank
        import torch

        out = {n: torch.zeros(self.layout.targets[n].target.layers, self.layout.targets[n].target.slices,
                              dtype=torch.int32) for n in self.targets}
        for piece in [r.piece for r in (*self.direct, *self.staged)] + list(self.mapped):
            if piece.role == "A":  # rows s*R : s*R + r of a[layer]
                out[piece.target][piece.layer, piece.to_rows[0] // R] = piece.to_rows[1] - piece.to_rows[0]
        for st in self.stacked:  # every expert's slices at the module's rank
            out[st.target][st.layer] = st.rank(self.layout.spec.targets[st.target])
        return out

    def folds(self, scalings: Mapping[str, float]) -> Folds:
        """How these modules' scalings go into the slots: once per distinct set of them."""
        key = tuple(scalings[m] for m in self.modules)
        if key not in self._folds:
            if len(self._folds) > 64:
                self._folds.clear()
            self._folds[key] = _folds(self, scalings)
        return self._folds[key]


class Folds(NamedTuple):
    """The slots' scaling, and each module's own scaling as a ratio to it, folded into B in float32 before
    the cast: per module, or over a target's whole b where every module of it has one ratio and was
    copied exactly."""

    scaling: float
    ratios: dict[str, float]
    whole: dict[str, float]


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


def _folds(p: Plan, scalings: Mapping[str, float]) -> Folds:
    scaling = node_scaling(scalings, p.modules)
    ratios = {m: scalings[m] / scaling for m in p.modules if scalings[m] != scaling}
    # Targets whose every module has one ratio and was copied exactly (in the store's dtype) fold their
    # whole b in place at once: a Qwen3-MoE adapter's experts at a rank of their own, 55,000 folds become one.
    seen: dict[str, set[tuple[float, bool]]] = {}
    for module, target, exact in p.owners:
        seen.setdefault(target, set()).add((ratios.get(module, 1.0), exact))
    whole = {}
    for target, kinds in seen.items():
        if len(kinds) == 1:
            ((ratio, exact),) = kinds
            if exact and ratio != 1.0:
                whole[target] = ratio
    ratios = {m: r for m, t, _ in p.owners if (r := ratios.get(m)) is not None and t not in whole}
    return Folds(scaling, ratios, whole)


def plan(ckpt: Checkpoint, layout: SlotLayout) -> Plan:
    """The pieces of the modules layout's spec serves (the rest are other nodes'), once per header."""
    key = ("plan", layout)
    memo = ckpt.header.memo
    if key not in memo:
        memo[key] = _plan(ckpt, layout)
    return memo[key]


def host_bytes(ckpt: Checkpoint, layout: SlotLayout) -> int:
    """The bytes the adapter's copy takes in a host tier laid out by layout, from its header alone: the
    same on every rank of a world size, so a byte budget decides alike everywhere."""
    return layout.nbytes(served_targets(ckpt, layout.spec))


def served_targets(ckpt: Checkpoint, spec: LoraSpec) -> tuple[str, ...]:
    """The targets of spec the checkpoint's modules fill, in the spec's order: the blocks its copy holds."""
    found = {loc.target for module in ckpt.modules(spec.convert_keys) if (loc := spec.locate(module)) is not None}
    return tuple(n for n in spec.targets if n in found)


def _plan(ckpt: Checkpoint, layout: SlotLayout) -> Plan:
    spec = layout.spec
    placed = []
    for module, keys in sorted(ckpt.modules(spec.convert_keys).items()):
        loc = spec.locate(module)
        if loc is not None:
            placed.append((module, loc, keys.roles["A"], keys.roles["B"]))
    targets = served_targets(ckpt, spec)
    ways = checkpoint_orientations(spec, ckpt)
    stacked = [Stacked(m, A, B, loc.target, loc.layer, ways[m])
               for m, loc, A, B in placed if spec.targets[loc.target].experts is not None and loc.slice is None]
    stacked_modules = {st.module for st in stacked}
    placed_alone = [p for p in placed if p[0] not in stacked_modules]
    pieces = _pieces(placed_alone, layout)
    direct, staged, mapped = _sort(pieces, layout, targets)
    dense = _dense(pieces, layout, targets, direct)
    whole = list({e.start: e for e in (*(q.entry for q in mapped), *(x for st in stacked for x in (st.A, st.B)))
                  }.values())
    staged, dense, staging, whole_at = _stage(staged, dense, layout, whole)
    item = layout.dtype.itemsize
    filled = Counter()
    for a, b in pieces:
        filled[a.target] += (a.rows[1] - a.rows[0]) * (a.columns[1] - a.columns[0])
        filled[b.target] += (b.rows[1] - b.rows[0]) * (b.columns[1] - b.columns[0])
    for st in stacked:  # every expert's rows at the module's rank, in every slice
        tl = layout.targets[st.target]
        r = st.rank(spec.targets[st.target])
        filled[st.target] += r * tl.target.slices * tl.a_shape[2] + r * tl.b_shape[1]
    dense_targets = {d.target for d in dense}
    partial = frozenset(n for n in targets if n not in dense_targets
                        and filled[n] < layout.targets[n].weight_bytes // item)
    ranks = [as_linear(A.shape)[0] for _, _, A, _ in placed_alone] + [st.rank(spec.targets[st.target])
                                                                     for st in stacked]
    whole_reads = [Read(e.start, e.nbytes, at, None) for e, at in whole_at]
    return Plan(layout, targets, SKEW + layout.nbytes(targets), _skew(direct, item), tuple(direct), tuple(staged),
                tuple(dense), tuple(mapped), _batches(direct), _batches([*staged, *whole_reads]), staging, partial,
                max(ranks, default=0), tuple(module for module, _, _, _ in placed), tuple(stacked),
                tuple((m, loc.target, A.torch_dtype == layout.dtype) for m, loc, A, _ in placed), tuple(whole_at))


def _pieces(placed: list, layout: SlotLayout) -> list[tuple[Piece, Piece]]:
    """(A, B) pieces of every placed module and slice, cut by the sharding rule: worked out once per target
    and slice it covers (the same for every layer and expert on it), then only the module's rank put in."""
    out = []
    cuts: dict[tuple[str, object], list[tuple[tuple[int, int], tuple[int, int], int, int]]] = {}
    for module, (target, layer, s_), A, B in placed:
        cut = cuts.get((target, s_))
        if cut is None:
            cut = cuts[target, s_] = _cuts(layout.targets[target], s_)
        r = as_linear(A.shape)[0]
        for columns, b_rows, a_to, b_to in cut:
            out.append((Piece(module, "A", A, (0, r), columns, target, layer, (a_to, a_to + r)),
                        Piece(module, "B", B, b_rows, (0, r), target, layer, (b_to, b_to + b_rows[1] - b_rows[0]))))
    return out


def _cuts(tl: TargetLayout, s_: object) -> list[tuple[tuple[int, int], tuple[int, int], int, int]]:
    """For a module on slices s_ of tl's target, per slice it covers: A's input columns this rank holds (all
    of them unless row-parallel), the rows of the module's B that are this rank's rows of that slice (found
    where the slice starts in B), and where A's and B's rows go in a[layer] and b[layer]."""
    t, out = tl.target, []
    starts = t.module_rows(s_)
    for s in t.covered(s_):
        (r0, r1), src = tl.shard.rows[s], starts[s]
        out.append((tl.shard.columns, (src + r0, src + r1), tl.a_rows(s).start, tl.b_rows(s).start))
    return out


def _sort(pieces: list[tuple[Piece, Piece]], layout: SlotLayout, targets: tuple[str, ...],
          ) -> tuple[list[Read], list[Piece], list[Piece]]:
    """Pieces by how they are copied: direct reads (with their place), pieces to stage, pieces to map."""
    offsets, R, item = layout.offsets(targets), layout.spec.max_rank, layout.dtype.itemsize
    # per target: where its a and its b begin in the buffer, and the rows of a[layer] and b[layer]
    at = {n: (offsets[n], offsets[n] + layout.targets[n].b_offset * item, layout.targets[n].a_shape[1],
              layout.targets[n].b_shape[1]) for n in targets}
    same = {name for name, dtype in torch_dtypes().items() if dtype == layout.dtype}
    direct, staged, mapped = [], [], []
    for a, b in pieces:
        a_at, b_at, a_rows, b_rows = at[a.target]
        r, cols = as_linear(a.entry.shape)
        exact = a.entry.dtype in same
        if a.columns != (0, cols):
            mapped.append(a)
        elif exact:
            to = a_at + (a.layer * a_rows + a.to_rows[0]) * cols * item
            direct.append(Read(a.entry.start, r * cols * item, to, a))
        else:
            staged.append(a)
        if exact and r == R:
            to = b_at + (b.layer * b_rows + b.to_rows[0]) * R * item
            direct.append(Read(b.entry.start + b.rows[0] * r * item, (b.rows[1] - b.rows[0]) * r * item, to, b))
        else:
            staged.append(b)
    return direct, staged, mapped


def _dense(pieces: list[tuple[Piece, Piece]], layout: SlotLayout, targets: tuple[str, ...],
           direct: list[Read]) -> list[Dense]:
    """Targets whose B is staged and whose every layer and slice has one module, all of one rank."""
    by_target: dict[str, list[Piece]] = {}
    for _, b in pieces:
        by_target.setdefault(b.target, []).append(b)
    targets = tuple(n for n in targets if n in by_target)
    read_direct = {d.piece.target for d in direct if d.piece.role == "B"}
    dense = []
    for name in targets:
        t, bs = layout.targets[name].target, by_target[name]
        ranks = {b.columns[1] for b in bs}
        whole = len(bs) == len({(b.layer, b.to_rows) for b in bs}) == t.layers * t.slices
        if name not in read_direct and len(ranks) == 1 and whole:
            dense.append(Dense(name, ranks.pop(), 0, bs[0].entry.torch_dtype))
    return dense


def _stage(staged: list[Piece], dense: list[Dense], layout: SlotLayout, whole: list[TensorEntry],
           ) -> tuple[list[Read], list[Dense], int, list[tuple[TensorEntry, int]]]:
    """Places in the staging buffer: a dense target's B as one [layers, out_shard, r] array, the rest one
    after another, then the tensors staged whole, each where its address agrees with the file's modulo
    SKEW where it can."""
    reads, at = [], 0
    placed_dense = []
    by_target = {d.target: d for d in dense}
    for d in dense:
        tl = layout.targets[d.target]
        first = min((p for p in staged if p.target == d.target and p.role == "B"), key=lambda p: (p.layer, p.to_rows))
        size = d.dtype.itemsize * d.rank
        at = _place(at, first.entry.start + first.rows[0] * size, d.dtype)
        placed_dense.append(d._replace(at=at))
        for p in staged:
            if p.target == d.target and p.role == "B":
                to = at + (p.layer * tl.b_shape[1] + p.to_rows[0]) * size
                reads.append(Read(p.entry.start + p.rows[0] * size, (p.rows[1] - p.rows[0]) * size, to, p))
        at += tl.target.layers * tl.b_shape[1] * size
    for p in staged:
        if p.role == "B" and p.target in by_target:
            continue
        size = p.entry.torch_dtype.itemsize * as_linear(p.entry.shape)[1]
        start = p.entry.start + p.rows[0] * size
        at = _place(at, start, p.entry.torch_dtype)
        reads.append(Read(start, (p.rows[1] - p.rows[0]) * size, at, p))
        at += (p.rows[1] - p.rows[0]) * size
    whole_at = []
    for e in whole:
        at = _place(at, e.start, e.torch_dtype)
        whole_at.append((e, at))
        at += e.nbytes
    return reads, placed_dense, at, whole_at


def _place(at: int, start: int, dtype: torch.dtype) -> int:
    """The first offset from at whose address agrees with the file offset start modulo SKEW, where start is
    aligned for dtype; else the first aligned for dtype (a header of any length is valid, so a file's tensors
    may lie off their alignment, and staged bytes are viewed as their dtype)."""
    if start % dtype.itemsize == 0:
        return at + (start - at) % SKEW
    return at + (-at) % dtype.itemsize


def _skew(direct: list[Read], itemsize: int) -> int:
    """The offset of the blocks in their buffer that puts most direct bytes at the address the file
    has them at, modulo SKEW; a whole number of elements, so every view stays aligned for its dtype."""
    weight: Counter[int] = Counter()
    for d in direct:
        weight[(d.at - d.to) % SKEW] += d.nbytes
    fits = [(n, -k) for k, n in weight.items() if k % itemsize == 0]
    return -max(fits)[1] if fits else 0


def _batches(reads: list[Read]) -> tuple[Batch, ...]:
    """Reads in file order, joined into one preadv wherever each starts where the last ended, in
    batches of about BATCH_BYTES."""
    batches: list[list[Run]] = [[]]
    start = end = 0
    parts: list[tuple[int, int]] = []
    done = 0  # bytes of the finished batches and the current one
    for at, n, to, _ in sorted(reads, key=lambda r: (r.at, r.to)):
        full = done >= BATCH_BYTES * len(batches)
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
