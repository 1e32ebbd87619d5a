"""What a plan tells a read to copy, as data: pieces of factors, their reads, dense targets' B, stacked
experts' factors and how their experts move into the slices, tensors staged whole. The plan (plan.py) works
them out once per header; the reader (reader.py) follows them and asks nothing back."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from .experts import stacked_widths
from .safetensors_header import TensorEntry
from .spec import LoraTarget, as_linear

if TYPE_CHECKING:
    import torch

    from .layout import SlotLayout


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
    width: int = 0  # the factor's columns, as a linear's: its rows' length in elements


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


class Staged(NamedTuple):
    """A tensor staged whole: its bytes from offset at of the staging buffer, a linear's [rows, columns]."""

    at: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class StackedCopy(NamedTuple):
    """A stacked module's every expert moved from the staging buffer into its slices, as experts.py says A and
    B hold them: all the numbers the copy takes, worked out by the plan."""

    module: str
    target: str
    layer: int
    A: Staged
    B: Staged
    a_in: bool  # A on the input side ("A in"), else B's transpose is the input-side factor
    count: int  # experts
    per: int  # slices an expert has (gate and up: 2)
    r: int
    fan_in: int
    fan_out: int  # an expert's out, over all its slices
    width: int  # one slice's out
    interleaved: bool  # gate and up rows alternate (gpt-oss)
    columns: tuple[int, int]  # this rank's columns of A
    rows: tuple[tuple[int, int], ...]  # this rank's rows of each slice's B


def staged_whole(e: TensorEntry, at: dict[int, int]) -> Staged:
    """e staged whole, where at (by start in the file) puts it."""
    return Staged(at[e.start], e.nbytes, e.torch_dtype, as_linear(e.shape))


def stacked_copy(st: Stacked, layout: SlotLayout, at: dict[int, int]) -> StackedCopy:
    """How st's experts move into layout's slices, its factors staged whole where at puts them."""
    tl = layout.targets[st.target]
    t = tl.target
    count, (fan_in, fan_out) = t.experts.count, stacked_widths(t)
    per = t.slices // count
    return StackedCopy(st.module, st.target, st.layer, staged_whole(st.A, at), staged_whole(st.B, at),
                       st.orientation == "A in", count, per, st.rank(t), fan_in, fan_out, t.out_features[0],
                       t.experts.interleaved, tl.shard.columns, tuple(tl.shard.rows[j] for j in range(per)))
