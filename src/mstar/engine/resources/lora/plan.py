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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain, compress, repeat
from operator import attrgetter, is_not, itemgetter, methodcaller
from typing import TYPE_CHECKING

from .acyclic import untrack
from .checkpoint import Checkpoint
from .copies import Dense, Piece, Read, Stacked, StackedCopy, Staged, stacked_copy, staged_whole
from .experts import checkpoint_orientations
from .folds import FoldRow, Folds, fold
from .layout import SlotLayout
from .rows import Batch, Reads, Table, batches, compile_table, skew
from .safetensors_header import TensorEntry, torch_dtypes
from .spec import Location, LoraSpec, as_linear

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
# A row target's A is cut by columns, so this rank's part of each of its rows lies apart from the next: a
# row part at least this long is read alone (one preadv each), a shorter one with its whole tensor.
SHARD_ROW = 1024
# Distinct scalings whose Folds a plan keeps (one header read under many: files of one recipe, alphas their own).
# Each holds its fold rows: about 2 MB for a per-expert Qwen3-MoE header whose experts fold, so at most ~32 MB.
FOLDS_KEPT = 16


@dataclass(frozen=True, eq=False)
class Plan:
    """How one header's adapter is copied into one layout: the same for every file with that header, and
    all a read needs to know, so that it follows the plan over any source without asking the checkpoint,
    the spec or experts.py anything: the stacked modules' copies (StackedCopy), the tensors staged whole
    (Staged), each staged read's width and, in its Folds, the rows each scaling folds into are worked out here.
    Its pieces are a Table's rows and its reads are columns (rows.py); only pieces staged one by one (cast,
    or B at a rank of its own where its target is not dense) and mapped ones are objects."""

    layout: SlotLayout
    targets: tuple[str, ...]  # in buffer order
    nbytes: int  # the buffer's: the blocks, from skew on
    skew: int
    table: Table  # every piece, but for stacked experts'
    direct: Reads  # into the blocks
    dense_reads: Reads  # dense targets' B, into the staging buffer
    spread_reads: tuple[Read, ...]  # the other staged pieces, copied one by one
    dense: tuple[Dense, ...]
    batches: tuple[Batch, ...]  # direct reads
    staged_batches: tuple[Batch, ...]
    staging: int  # the staging buffer's bytes
    partial: frozenset[str]  # targets, not dense, whose blocks the pieces do not fill
    rank: int  # the largest module rank among the pieces
    modules: tuple[str, ...]
    stacked: tuple[Stacked, ...] = ()  # every expert's factors in one pair, copied a layer at a time
    owners: tuple[tuple[str, str, bool], ...] = ()  # (module, its target, whether it is in the store's dtype)
    whole: tuple[tuple[TensorEntry, int], ...] = ()  # tensors staged whole (mapped pieces', stacked ones'), and where
    stacked_copies: tuple[StackedCopy, ...] = ()
    mapped_copies: tuple[tuple[Piece, Staged], ...] = ()  # each mapped piece and its tensor, staged whole
    _folds: dict = field(default_factory=dict, repr=False)

    @cached_property
    def staged(self) -> tuple[Read, ...]:
        """Every read of a piece into the staging buffer, as objects: dense targets' B, then the rest."""
        d = self.dense_reads
        pieces = [_piece(self.table, i, "B") for i in d.piece.tolist()]
        dense = [Read(at, n, to, q, as_linear(q.entry.shape)[1]) for at, n, to, q in
                 zip(d.at.tolist(), d.nbytes.tolist(), d.to.tolist(), pieces, strict=True)]
        return (*dense, *self.spread_reads)

    def fold_rows(self, reads: Reads, ratios: Mapping[str, float], staged: bool) -> tuple[FoldRow, ...]:
        """Each of reads (B's, of the table's rows) whose module folds its own scaling: where it lies, from the
        staging buffer where staged, else in place."""
        t, out = self.table, []
        for j, ratio in self.module_ratios(reads, ratios):
            i = int(reads.piece[j])
            B = t.entries[int(t.module[i])][1]
            out.append(FoldRow(t.names[int(t.target[i])], int(t.layer[i]), int(t.b_to[i]), int(t.b1[i] - t.b0[i]),
                               int(t.r[i]), int(reads.to[j]) if staged else -1, int(reads.nbytes[j]),
                               B.torch_dtype, ratio))
        untrack(out)  # a name, numbers and a dtype: in no cycle (acyclic.py); a plan's folds keep one a module
        return tuple(out)

    def module_ratios(self, reads: Reads, ratios: Mapping[str, float]) -> list[tuple[int, float]]:
        """(read, ratio) for each of reads whose piece's module folds its own scaling by a ratio."""
        if not ratios or not len(reads):
            return []
        import torch

        index = self._module_index
        mine = [(index[m], r) for m, r in ratios.items() if m in index]
        if not mine:
            return []
        ratio = torch.zeros(len(self.table.modules), dtype=torch.float64)
        has = torch.zeros(len(self.table.modules), dtype=torch.bool)
        ids = torch.tensor([i for i, _ in mine], dtype=torch.int64)
        ratio[ids] = torch.tensor([r for _, r in mine], dtype=torch.float64)
        has[ids] = True
        modules = self.table.module[reads.piece]
        js = torch.nonzero(has[modules]).flatten()
        return list(zip(js.tolist(), ratio[modules[js]].tolist(), strict=True))

    @cached_property
    def _module_index(self) -> dict[str, int]:
        return {m: i for i, m in enumerate(self.table.modules)}

    @cached_property
    def ranks(self) -> dict[str, torch.Tensor]:
        """target -> [layers, slices] int32: each served module's real rank (0 where there is none), which
        the device pool keeps beside its slot so the kernels multiply ranks, not max_rank. Read-only:
        adapters of one recipe share it."""
        R = self.layout.spec.max_rank
        import torch

        out = {n: torch.zeros(self.layout.targets[n].target.layers, self.layout.targets[n].target.slices,
                              dtype=torch.int32) for n in self.targets}
        t = self.table
        for i, name in enumerate(t.names):
            rows = torch.nonzero(t.target == i).flatten()
            if len(rows):  # A's rows s*R : s*R + r of a[layer]
                out[name][t.layer[rows], t.a_to[rows] // R] = t.r[rows].to(torch.int32)
        for st in self.stacked:  # every expert's slices at the module's rank
            out[st.target][st.layer] = st.rank(self.layout.spec.targets[st.target])
        return out

    def folds(self, scalings: Mapping[str, float]) -> Folds:
        """How these modules' scalings go into the slots: once per distinct set of them, and without a look at
        them for the very mapping given last (a header's scalings under its config, which every read of the
        header is given: 18,624 lookups a read for the per-expert Qwen3-MoE adapter)."""
        last = self._folds.get("last")
        if last is not None and last[0] is scalings:
            return last[1]
        key = tuple(scalings[m] for m in self.modules)
        if key not in self._folds:
            if len(self._folds) > FOLDS_KEPT:
                self._folds.clear()
            folds = fold(scalings, self.modules, self.owners)
            self._folds[key] = folds._replace(
                staged_rows=self.fold_rows(self.dense_reads, folds.ratios, True),
                direct_rows=self.fold_rows(self.direct.where(self.direct.role == 1), folds.ratios, False))
        self._folds["last"] = (scalings, self._folds[key])
        return self._folds[key]


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
    return _targets_of(spec, (loc for _, loc, _, _ in placed_modules(ckpt, spec)))


def _targets_of(spec: LoraSpec, locations: Iterable[Location]) -> tuple[str, ...]:
    found = {loc.target for loc in locations}
    return tuple(n for n in spec.targets if n in found)


def placed_modules(ckpt: Checkpoint, spec: LoraSpec) -> list[tuple[str, Location, TensorEntry, TensorEntry]]:
    """(module, its location, A, B) of every module spec maps, by name: once per header and spec. A or B is
    None where the module lacks it (which its check refuses before any plan; host_bytes may come first)."""
    key = ("placed", spec)
    memo = ckpt.header.memo
    if key not in memo:
        modules = ckpt.modules(spec.convert_keys)
        names = sorted(modules)
        locs = spec.locate_all(names)
        mask = list(map(is_not, locs, repeat(None)))
        ab = getattr(modules, "ab", None)
        # in passes over whole columns: tens of thousands of modules in a per-expert file
        if ab is not None and ab[0] == names:  # every module an A and a B, listed by name (as safetensors writes)
            a, b = compress(ab[1], mask), compress(ab[2], mask)
        else:
            roles = list(map(attrgetter("roles"), map(modules.__getitem__, compress(names, mask))))
            a, b = map(methodcaller("get", "A"), roles), map(methodcaller("get", "B"), roles)
        placed = list(zip(compress(names, mask), compress(locs, mask), a, b, strict=True))
        if set(map(type, chain(map(itemgetter(2), placed), map(itemgetter(3), placed)))) <= {TensorEntry, type(None)}:
            untrack(placed)  # names, Locations and entries: in no cycle (acyclic.py)
        memo[key] = placed
    return memo[key]


def _plan(ckpt: Checkpoint, layout: SlotLayout) -> Plan:
    spec = layout.spec
    placed = placed_modules(ckpt, spec)
    targets = _targets_of(spec, (loc for _, loc, _, _ in placed))
    ways = checkpoint_orientations(spec, ckpt)
    experts = {n for n, t in spec.targets.items() if t.experts is not None}
    stacked = [Stacked(m, A, B, loc.target, loc.layer, ways[m])
               for m, loc, A, B in placed if loc.slice is None and loc.target in experts] if experts else []
    stacked_modules = {st.module for st in stacked}
    placed_alone = [p for p in placed if p[0] not in stacked_modules] if stacked else placed
    t = compile_table(placed_alone, layout)
    direct, a_staged, b_staged, mapped_rows = _sort(t, layout, targets)
    dense = _dense(t, layout, targets, direct)
    mapped = tuple(_piece(t, i, "A") for i in torch_list(mapped_rows))
    whole = list({e.start: e for e in (*(q.entry for q in mapped), *(x for st in stacked for x in (st.A, st.B)))
                  }.values())
    dense_reads, spread, dense, staging, whole_at = _stage(t, a_staged, b_staged, dense, layout, whole)
    item = layout.dtype.itemsize
    partial = _partial(t, layout, targets, stacked, {d.target for d in dense})
    ranks = [int(t.r.max())] if len(t) else []
    ranks += [st.rank(spec.targets[st.target]) for st in stacked]
    staged_reads = Reads.join([dense_reads, Reads.of([r.at for r in spread], [r.nbytes for r in spread],
                                                     [r.to for r in spread]),
                               Reads.of([e.start for e, _ in whole_at], [e.nbytes for e, _ in whole_at],
                                        [at for _, at in whole_at])])
    at = {e.start: a for e, a in whole_at}
    return Plan(layout, targets, SKEW + layout.nbytes(targets), skew(direct, item, SKEW), t, direct, dense_reads,
                tuple(spread), tuple(dense), _batches(direct), _batches(staged_reads), staging, partial,
                max(ranks, default=0), tuple(module for module, _, _, _ in placed), tuple(stacked),
                _owners(placed, layout), tuple(whole_at), tuple(stacked_copy(st, layout, at) for st in stacked),
                tuple((q, staged_whole(q.entry, at)) for q in mapped))


def _owners(placed: list, layout: SlotLayout) -> tuple[tuple[str, str, bool], ...]:
    """(module, its target, whether it is in the store's dtype) of every placed module."""
    same = {name for name, dtype in torch_dtypes().items() if dtype == layout.dtype}
    return tuple((m, loc.target, A.dtype in same) for m, loc, A, _ in placed)


def torch_list(rows: torch.Tensor) -> list[int]:
    return rows.flatten().tolist()


def _piece(t: Table, i: int, role: str) -> Piece:
    """Table row i's A or B as a Piece (the pieces copied one by one, and those staged whole)."""
    m, target, layer, r, c0, c1, b0, b1, a_to, b_to = (int(t.columns[c][i]) for c in (
        "module", "target", "layer", "r", "c0", "c1", "b0", "b1", "a_to", "b_to"))
    A, B = t.entries[m]
    if role == "A":
        return Piece(t.modules[m], "A", A, (0, r), (c0, c1), t.names[target], layer, (a_to, a_to + r))
    return Piece(t.modules[m], "B", B, (b0, b1), (0, r), t.names[target], layer, (b_to, b_to + b1 - b0))


def _partial(t: Table, layout: SlotLayout, targets: tuple[str, ...], stacked: list[Stacked],
             dense: set[str]) -> frozenset[str]:
    """Targets, not dense, whose blocks the pieces and stacked experts do not fill."""
    import torch

    spec, item = layout.spec, layout.dtype.itemsize
    filled = [0] * len(t.names)
    if len(t):
        weights = (t.r * (t.c1 - t.c0) + (t.b1 - t.b0) * t.r).double()
        filled = torch.bincount(t.target, weights=weights, minlength=len(t.names)).long().tolist()
    by_name = dict(zip(t.names, filled, strict=True))
    for st in stacked:  # every expert's rows at the module's rank, in every slice
        tl = layout.targets[st.target]
        r = st.rank(spec.targets[st.target])
        by_name[st.target] += r * tl.target.slices * tl.a_shape[2] + r * tl.b_shape[1]
    return frozenset(n for n in targets if n not in dense and by_name[n] < layout.targets[n].weight_bytes // item)


def _sort(t: Table, layout: SlotLayout, targets: tuple[str, ...],
          ) -> tuple[Reads, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pieces by how they are copied, over whole columns: the direct reads (with their place), masks of
    the rows whose A is staged and whose B is staged, and the rows whose A is mapped (a row target's column
    shard staged whole: cast, or in rows too short to read alone)."""
    import torch

    offsets, R, item = layout.offsets(targets), layout.spec.max_rank, layout.dtype.itemsize
    # per target: where its a and its b begin in the buffer, and the rows of a[layer] and b[layer]
    where = torch.zeros(4, len(t.names), dtype=torch.int64)
    for i, n in enumerate(t.names):
        if n in offsets:
            tl = layout.targets[n]
            where[:, i] = torch.tensor([offsets[n], offsets[n] + tl.b_offset * item, tl.a_shape[1], tl.b_shape[1]])
    a_at, b_at, a_rows, b_rows = (w[t.target] for w in where)
    whole = (t.c0 == 0) & (t.c1 == t.cols)
    a_direct, b_direct = whole & t.exact, t.exact & (t.r == R)
    pieces = torch.arange(len(t), dtype=torch.int64)
    a = Reads(t.a_start, t.r * t.cols * item, a_at + (t.layer * a_rows + t.a_to) * t.cols * item, pieces,
              torch.zeros_like(pieces)).where(a_direct)
    b = Reads(t.b_start + t.b0 * t.r * item, (t.b1 - t.b0) * t.r * item,
              b_at + (t.layer * b_rows + t.b_to) * R * item, pieces, torch.ones_like(pieces)).where(b_direct)
    # a row target's column shard of A, where a row of it is at least SHARD_ROW: each of its r rows read
    # alone into its row of a[layer] (the rest of A, the other ranks' columns, is not read)
    shard = ~whole & t.exact & ((t.c1 - t.c0) * item >= SHARD_ROW)
    rows = torch.nonzero(shard).flatten()
    reps = t.r[rows]
    of = torch.repeat_interleave(rows, reps)
    i = torch.arange(len(of), dtype=torch.int64) - torch.repeat_interleave(torch.cumsum(reps, 0) - reps, reps)
    width = (t.c1 - t.c0)[of] * item
    a_shard = Reads(t.a_start[of] + (i * t.cols[of] + t.c0[of]) * item, width,
                    a_at[of] + (t.layer[of] * a_rows[of] + t.a_to[of] + i) * width, of, torch.zeros_like(of))
    return Reads.join([a, a_shard, b]), whole & ~t.exact, ~b_direct, torch.nonzero(~whole & ~shard).flatten()


def _dense(t: Table, layout: SlotLayout, targets: tuple[str, ...], direct: Reads) -> list[Dense]:
    """Targets whose B is staged and whose every layer and slice has one module, all of one rank."""
    import torch

    index = {n: i for i, n in enumerate(t.names)}
    read_direct = set(torch_list(t.target[direct.piece[direct.role == 1]])) if len(direct) else set()
    dense = []
    for name in targets:
        i = index[name]
        rows = torch.nonzero(t.target == i).flatten()
        if not len(rows) or i in read_direct:
            continue
        tt, ranks = layout.targets[name].target, torch.unique(t.r[rows])
        places = torch.stack([t.layer[rows], t.b_to[rows], t.b1[rows] - t.b0[rows]], 1)
        if len(ranks) == 1 and len(rows) == len(torch.unique(places, dim=0)) == tt.layers * tt.slices:
            B = t.entries[int(t.module[rows[0]])][1]
            dense.append(Dense(name, int(ranks[0]), 0, B.torch_dtype))
    return dense


def _stage(t: Table, a_staged: torch.Tensor, b_staged: torch.Tensor, dense: list[Dense], layout: SlotLayout,
           whole: list[TensorEntry]) -> tuple[Reads, list[Read], list[Dense], int, list[tuple[TensorEntry, int]]]:
    """Places in the staging buffer: a dense target's B as one [layers, out_shard, r] array (its reads over
    whole columns), the rest one after another (a Read each), then the tensors staged whole, each where its
    address agrees with the file's modulo SKEW where it can."""
    import torch

    index = {n: i for i, n in enumerate(t.names)}
    at, placed_dense, dense_reads = 0, [], []
    for d in dense:
        tl = layout.targets[d.target]
        rows = torch.nonzero((t.target == index[d.target]) & b_staged).flatten()
        first = int(rows[torch.argmin(t.layer[rows] * (tl.b_shape[1] + 1) + t.b_to[rows])])
        size = d.dtype.itemsize * d.rank
        at = _place(at, int(t.b_start[first] + t.b0[first] * size), d.dtype)
        placed_dense.append(d._replace(at=at))
        dense_reads.append(Reads(t.b_start[rows] + t.b0[rows] * size, (t.b1[rows] - t.b0[rows]) * size,
                                 at + (t.layer[rows] * tl.b_shape[1] + t.b_to[rows]) * size, rows,
                                 torch.ones_like(rows)))
        at += tl.target.layers * tl.b_shape[1] * size
    dense_ids = torch.tensor([index[d.target] for d in dense], dtype=torch.int64)
    b_spread = b_staged & ~torch.isin(t.target, dense_ids)
    order = torch.sort(torch.cat([torch.nonzero(a_staged).flatten() * 2, torch.nonzero(b_spread).flatten() * 2 + 1
                                  ])).values
    reads = []
    for k in torch_list(order):
        p = _piece(t, k // 2, "AB"[k % 2])
        size = p.entry.torch_dtype.itemsize * as_linear(p.entry.shape)[1]
        start = p.entry.start + p.rows[0] * size
        at = _place(at, start, p.entry.torch_dtype)
        reads.append(Read(start, (p.rows[1] - p.rows[0]) * size, at, p, as_linear(p.entry.shape)[1]))
        at += (p.rows[1] - p.rows[0]) * size
    whole_at = []
    for e in whole:
        at = _place(at, e.start, e.torch_dtype)
        whole_at.append((e, at))
        at += e.nbytes
    empty = Reads.of([], [], [])
    return Reads.join([empty, *dense_reads]), reads, placed_dense, at, whole_at


def _place(at: int, start: int, dtype: torch.dtype) -> int:
    """The first offset from at whose address agrees with the file offset start modulo SKEW, where start is
    aligned for dtype; else the first aligned for dtype (a header of any length is valid, so a file's tensors
    may lie off their alignment, and staged bytes are viewed as their dtype)."""
    if start % dtype.itemsize == 0:
        return at + (start - at) % SKEW
    return at + (-at) % dtype.itemsize


def _batches(reads: Reads) -> tuple[Batch, ...]:
    return batches(reads, BATCH_BYTES, RUN_BYTES, IOV_MAX)
