"""A header's pieces compiled per template, and its reads as rows: the plan's data, not its objects.

The names of a large adapter are a handful of templates repeated over layers and experts: every layer's
q_proj, every expert's gate_proj. What a piece is (its rank, its columns, this rank's rows of B, where its
rows go in a[layer] and b[layer], whether it is in the store's dtype) follows from its target, its slice,
its factors' shapes and dtypes alone; so it is worked out once per template, and each module adds only
its layer, its module index and where its two tensors start. The pieces are then columns of int64
tensors (a Table, one row per module and slice it covers), and every read of them (file offset, length,
destination) is worked out over whole columns at once, as are their batches, the blocks' skew and the
ranks kept beside the slot: no Python per tensor but the few appends that name it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING, NamedTuple

from .acyclic import untrack
from .safetensors_header import TensorEntry, torch_dtypes
from .spec import as_linear

if TYPE_CHECKING:
    import torch

    from .layout import SlotLayout, TargetLayout

Run = tuple[int, tuple[tuple[int, int], ...], int]  # one preadv: file offset, ((to, bytes), ...), their total
Batch = tuple[Run, ...]  # runs read one after another by one thread
COLUMNS = ("module", "target", "layer", "r", "cols", "c0", "c1", "b0", "b1", "a_to", "b_to", "a_start", "b_start",
           "exact")


class Template(NamedTuple):
    """What every module of one target, slice, shapes and dtypes shares: its target's index, rank, A's
    columns as a linear's, whether its factors are in the store's dtype, and per slice it covers (A's
    columns this rank holds, B's rows this rank holds, where A's and B's rows go in a[layer] and b[layer])."""

    target: int
    r: int
    cols: int
    exact: bool
    cuts: tuple[tuple[int, int, int, int, int, int], ...]


@dataclass(frozen=True, eq=False)
class Table:
    """Every placed module's A and B for each slice it covers, cut to this rank, as columns (int64 tensors of
    one row per piece): the module's index among modules, its target's among names, its layer, rank r, A's
    columns cols, A's columns this rank holds [c0, c1), B's rows [b0, b1), the first row in a[layer] (a_to)
    and b[layer] (b_to), where A and B start in the file, and whether both are in the store's dtype."""

    names: tuple[str, ...]  # targets by index
    modules: tuple[str, ...]  # modules by index
    entries: tuple[tuple[TensorEntry, TensorEntry], ...]  # (A, B) by module index
    columns: dict[str, torch.Tensor]

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self.__dict__["columns"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __len__(self) -> int:
        return len(self.columns["module"])


def compile_table(placed: Sequence[tuple[str, tuple[str, int, object], TensorEntry, TensorEntry]],
                  layout: SlotLayout) -> Table:
    """The Table of placed modules (module, its location, A, B): one template per distinct target, slice,
    shapes and A's dtype (B's is A's, or the check refused the module); per module, its template's index, its
    layer and its tensors' starts."""
    import torch

    names = tuple(layout.spec.targets)
    index = {n: i for i, n in enumerate(names)}
    ids: dict[tuple, int] = {}
    # unpacked, not read by attribute: the one pass over the modules, a few hundred ns each
    rows_of = [((target, s_, a_shape, b_shape, a_dtype), layer, a_start, b_start) for
               _, (target, layer, s_), (a_dtype, a_shape, a_start, _), (_, b_shape, b_start, _) in placed]
    keys, layers, a_starts, b_starts = zip(*rows_of, strict=True) if rows_of else ((), (), (), ())
    which = [ids.setdefault(k, len(ids)) for k in keys]
    same = {name for name, dtype in torch_dtypes().items() if dtype == layout.dtype}
    compiled = []
    for target, s_, a_shape, _, a_dtype in ids:  # in the order of their indices
        r, cols = as_linear(a_shape)
        compiled.append(Template(index[target], r, cols, a_dtype in same, _cuts(layout.targets[target], s_)))
    per_module = torch.tensor(which, dtype=torch.int64)
    counts = torch.tensor([len(t.cuts) for t in compiled], dtype=torch.int64)
    # each template's cuts flattened, and per module the first of its template's
    cuts = torch.tensor([c for t in compiled for c in t.cuts], dtype=torch.int64).reshape(-1, 6)
    first = torch.cumsum(counts, 0) - counts
    repeat = counts[per_module] if len(compiled) else per_module
    rows = torch.repeat_interleave(torch.arange(len(which), dtype=torch.int64), repeat)
    # a piece's cut: its template's first cut plus its place among its module's pieces
    within = torch.arange(len(rows), dtype=torch.int64) - torch.repeat_interleave(torch.cumsum(repeat, 0) - repeat,
                                                                                  repeat)
    cut = cuts[first[per_module[rows]] + within] if len(rows) else cuts[:0]
    template = torch.tensor([(t.target, t.r, t.cols, t.exact) for t in compiled], dtype=torch.int64).reshape(-1, 4)
    of = template[per_module[rows]]
    columns = {"module": rows, "target": of[:, 0], "layer": torch.tensor(layers, dtype=torch.int64)[rows],
               "r": of[:, 1], "cols": of[:, 2], "c0": cut[:, 0], "c1": cut[:, 1], "b0": cut[:, 2], "b1": cut[:, 3],
               "a_to": cut[:, 4], "b_to": cut[:, 5], "a_start": torch.tensor(a_starts, dtype=torch.int64)[rows],
               "b_start": torch.tensor(b_starts, dtype=torch.int64)[rows], "exact": of[:, 3].bool()}
    entries = tuple(zip(map(itemgetter(2), placed), map(itemgetter(3), placed), strict=True))
    if set(map(type, chain.from_iterable(entries))) <= {TensorEntry}:
        untrack(entries)  # pairs of entries: in no cycle, out of the collector's passes (acyclic.py)
    return Table(names, tuple(map(itemgetter(0), placed)), entries, columns)


def _cuts(tl: TargetLayout, s_: object) -> tuple[tuple[int, int, int, int, int, int], ...]:
    """For a module on slices s_ of tl's target, per slice it covers: A's input columns this rank holds (all
    of them unless row-parallel), the rows of the module's B that are this rank's rows of that slice (found
    where the slice starts in B), and where A's and B's rows go in a[layer] and b[layer]."""
    t, out = tl.target, []
    starts = t.module_rows(s_)
    for s in t.covered(s_):
        (r0, r1), src = tl.shard.rows[s], starts[s]
        out.append((*tl.shard.columns, src + r0, src + r1, tl.a_rows(s).start, tl.b_rows(s).start))
    return tuple(out)


class Reads(NamedTuple):
    """Reads as columns: where each starts in the file, its bytes, where it lands (from the blocks' start
    or the staging buffer's), and the piece (a Table row) and factor (0 A, 1 B) it reads."""

    at: torch.Tensor
    nbytes: torch.Tensor
    to: torch.Tensor
    piece: torch.Tensor
    role: torch.Tensor

    def __len__(self) -> int:
        return len(self.at)

    def where(self, mask: torch.Tensor) -> Reads:
        return Reads(*(c[mask] for c in self))

    @staticmethod
    def join(parts: Sequence[Reads]) -> Reads:
        import torch

        return Reads(*(torch.cat(cs) for cs in zip(*parts, strict=True)))

    @staticmethod
    def of(at: Sequence[int], nbytes: Sequence[int], to: Sequence[int]) -> Reads:
        """Reads of no piece (tensors staged whole, pieces staged one by one)."""
        import torch

        n = len(at)
        return Reads(torch.tensor(at, dtype=torch.int64), torch.tensor(nbytes, dtype=torch.int64),
                     torch.tensor(to, dtype=torch.int64), torch.full((n,), -1, dtype=torch.int64),
                     torch.full((n,), -1, dtype=torch.int64))


def skew(reads: Reads, itemsize: int, modulo: int) -> int:
    """The offset of the blocks in their buffer that puts most of reads' bytes at the address the file has
    them at, modulo modulo (the smallest of those that tie); a whole number of elements, so every view stays
    aligned for its dtype."""
    import torch

    if not len(reads):
        return 0
    weight = torch.bincount((reads.at - reads.to) % modulo, weights=reads.nbytes.double(), minlength=modulo)
    weight[torch.arange(modulo) % itemsize != 0] = -1
    best = int(weight.max())
    if best < 0:
        return 0
    return int(torch.nonzero(weight == best)[0])


def batches(reads: Reads, batch_bytes: int, run_bytes: int, iov_max: int) -> tuple[Batch, ...]:
    """Reads in file order, joined into one preadv wherever each starts where the last ended (at most iov_max
    parts and about run_bytes a run), in batches of about batch_bytes."""
    import torch

    if not len(reads):
        return ()
    order = torch.sort(reads.to, stable=True).indices
    order = order[torch.sort(reads.at[order], stable=True).indices]
    at, n, to = reads.at[order], reads.nbytes[order], reads.to[order]
    done = torch.cumsum(n, 0) - n  # bytes before each read
    batch = done // batch_bytes
    new_batch = torch.ones(len(at), dtype=torch.bool)
    new_batch[1:] = batch[1:] != batch[:-1]
    new_run = new_batch.clone()
    new_run[1:] |= at[1:] != (at + n)[:-1]
    new_run[1:] |= n[1:] > run_bytes - batch_bytes  # a read near run_bytes starts a run of its own
    # at most iov_max parts a run: a break every iov_max parts into a run that has none
    starts = torch.nonzero(new_run).flatten()
    run_of = torch.cumsum(new_run.long(), 0) - 1
    place = torch.arange(len(at)) - starts[run_of]
    new_run |= (place % iov_max == 0)
    starts = torch.nonzero(new_run).flatten().tolist()
    batch_starts = set(torch.nonzero(new_batch).flatten().tolist())
    parts = list(zip(to.tolist(), n.tolist(), strict=True))
    at_list, before = at.tolist(), [*done.tolist(), int(done[-1] + n[-1])]
    out: list[list[Run]] = []
    for i, (s, e) in enumerate(zip(starts, [*starts[1:], len(at_list)], strict=True)):
        if i == 0 or s in batch_starts:
            out.append([])
        out[-1].append((at_list[s], tuple(parts[s:e]), before[e] - before[s]))
    return tuple(tuple(b) for b in out)
