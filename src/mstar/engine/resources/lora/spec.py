"""What a deployment can serve: the fused linears LoRA applies to, and how each shards."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import repeat
from typing import TYPE_CHECKING, Literal, NamedTuple

from .acyclic import untrack
from .keys import ConvertKeys, peft_keys

if TYPE_CHECKING:
    import torch

Parallel = Literal["column", "row", "replicated"]
Slices = int | tuple[int, ...] | None  # which slices of its target a module covers (see LoraTarget.covered)
_UNSEEN = object()  # a module not located yet (None is a module located nowhere)


def bfloat16() -> torch.dtype:
    """The host tier's and the slots' default dtype, torch imported only where one is made with it (the
    startup check, which passes its own, imports none)."""
    import torch

    return torch.bfloat16


def as_linear(shape: Sequence[int]) -> tuple[int, ...]:
    """A LoRA factor's shape as a linear's: a conv adapter's A [r, c, *kernel] and B [out, r, 1, ...]
    flatten to [r, c * prod(kernel)] and [out, r], which is the delta on a conv whose kernel is its
    stride, over the flattened patch."""
    shape = tuple(shape)
    if len(shape) <= 2:
        return shape
    return (shape[0], math.prod(shape[1:]))


def canonical_index(text: str) -> bool:
    """Whether text is a layer or expert index as models name their modules: ASCII digits, no leading zero."""
    return text.isascii() and text.isdigit() and (text == "0" or text[0] != "0")


def shard_units(units: int, unit: int, rank: int, world_size: int) -> tuple[int, int]:
    """The rows [start, stop) rank takes of units blocks of unit rows each.

    With at least as many units as ranks each rank takes an equal run of them; with fewer
    (a GQA model's KV heads on many ranks) rank k takes unit k // (n / units), which the
    ranks sharing it replicate.
    """
    if units >= world_size:
        if units % world_size:
            raise ValueError(f"{units} units do not split over {world_size} ranks")
        per = units // world_size
        return rank * per * unit, (rank + 1) * per * unit
    if world_size % units:
        raise ValueError(f"{units} units cannot be replicated evenly over {world_size} ranks")
    u = rank // (world_size // units)
    return u * unit, (u + 1) * unit


@dataclass(frozen=True)
class LoraTarget:
    """One fused linear of the engine (or a conv applied as one) that adapters may touch.

    Widths are unsharded; every sharded size follows from them and (rank, world_size).
    """

    layers: int
    in_features: int
    out_features: tuple[int, ...]
    parallel: Parallel
    heads: tuple[int | None, ...] | None = None
    kernel: tuple[int, ...] | None = None  # a conv target's kernel; in_features = c * prod(kernel)
    experts: Experts | None = None  # for a mixture-of-experts target: its slices, expert-major
    # The model's layers that have it, in order, where not every one of range(layers) does (a hybrid
    # model's attention, a dense first layer beside MoE layers): it holds bytes for those alone.
    layer_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.parallel not in ("column", "row", "replicated"):
            raise ValueError(f"parallel must be column, row or replicated, not {self.parallel!r}")
        if self.experts is not None and self.slices % self.experts.count:
            raise ValueError(f"{self.slices} slices are not {self.experts.count} experts' alike")
        if self.heads is not None and len(self.heads) != len(self.out_features):
            raise ValueError("heads needs one head count per slice")
        if self.kernel is not None and self.in_features % math.prod(self.kernel):
            raise ValueError(f"in_features {self.in_features} is not channels * prod{self.kernel}")
        ids = self.layer_ids
        if ids is not None and (len(ids) != self.layers or list(ids) != sorted(set(ids)) or any(i < 0 for i in ids)):
            raise ValueError(f"layer_ids {list(ids)} are not {self.layers} increasing layer indices")

    def row(self, layer: int) -> int | None:
        """Where the model's layer lies among this target's layers; None where that layer has none."""
        if self.layer_ids is None:
            return layer
        return self._rows.get(layer)

    @cached_property
    def _rows(self) -> dict[int, int]:
        return {layer: i for i, layer in enumerate(self.layer_ids or ())}

    @property
    def slices(self) -> int:
        return len(self.out_features)

    @property
    def in_channels(self) -> int:
        """A conv target's input channels; a linear's input width."""
        return self.in_features // math.prod(self.kernel or (1,))

    def covered(self, s: Slices) -> Sequence[int]:
        """The slices a module on s fills, in the order its B holds them: all for s None (a module fused
        in the base model), one for an int, and those a tuple names (BFL's final adaLN holds shift then
        scale, diffusers' scale then shift)."""
        if s is None:
            return range(self.slices)
        return (s,) if isinstance(s, int) else s

    def module_rows(self, s: Slices) -> dict[int, int]:
        """Where each slice a module on s covers begins among the rows of that module's B."""
        at, out = 0, {}
        for sl in self.covered(s):
            out[sl] = at
            at += self.out_features[sl]
        return out

    # The sharding rule. A row target splits A's input columns in equal chunks and keeps B whole; a
    # column target keeps A whole and gives each slice's B rows out by heads (or rows) through
    # shard_units; a replicated target shards nothing.

    def a_columns(self, rank: int, world_size: int) -> tuple[int, int]:
        """The input columns of A this rank holds: a row-parallel target splits its input."""
        if self.parallel != "row":
            return 0, self.in_features
        if self.in_features % world_size:
            raise ValueError(f"in_features {self.in_features} does not split over {world_size} ranks")
        chunk = self.in_features // world_size
        return rank * chunk, (rank + 1) * chunk

    def b_rows(self, s: int, rank: int, world_size: int) -> tuple[int, int]:
        """The rows of slice s's B this rank holds: a column-parallel target shards each slice."""
        out = self.out_features[s]
        if self.parallel != "column":
            return 0, out
        units = self.heads[s] if self.heads and self.heads[s] else out
        if out % units:
            raise ValueError(f"slice {s}'s width {out} is not a whole number of its {units} heads")
        try:
            return shard_units(units, out // units, rank, world_size)
        except ValueError as e:
            raise ValueError(f"slice {s} ({'heads' if self.heads and self.heads[s] else 'rows'}): {e}") from None

    def shard(self, rank: int, world_size: int) -> Shard:
        """This rank's part of the target, by the rule above."""
        rows = tuple(self.b_rows(s, rank, world_size) for s in range(self.slices))
        return Shard(self.a_columns(rank, world_size), rows)

    def check(self, world_size: int) -> None:
        """Raise ValueError when this target cannot shard over world_size ranks."""
        for rank in range(world_size):
            self.shard(rank, world_size)


class Shard(NamedTuple):
    """One rank's part of a target: A's input columns, and per slice the rows of that slice's B."""

    columns: tuple[int, int]
    rows: tuple[tuple[int, int], ...]

    def widths(self) -> tuple[int, ...]:
        """Each slice's rows on this rank (equal on every rank)."""
        return tuple(stop - start for start, stop in self.rows)


class Experts(NamedTuple):
    """How a target's slices are experts: count of them, each owning slices // count slices in a row
    (gate then up, or down alone); how the model stores the experts' stacked weight, [E, out, in]
    ("out_in", as a linear's) or [E, in, out] ("in_out", as gpt-oss); and whether the output rows of
    one expert's slices interleave (gpt-oss: gate, up, gate, up, ...) rather than follow each other."""

    count: int
    layout: Literal["out_in", "in_out"] = "out_in"
    interleaved: bool = False


class PerExpert(NamedTuple):
    """A pattern's slice for per-expert modules: per * the expert its group "expert" names, plus offset
    (gate_proj of expert 5 is slice 10 of experts_gate_up, up_proj slice 11)."""

    per: int
    offset: int


class Location(NamedTuple):
    """Where a checkpoint module lands: its target, layer (its row among the target's layers, which is the
    model's layer where the target is on every one) and slice (None where it covers every slice, a tuple
    where it covers those, in that order)."""

    target: str
    layer: int
    slice: Slices


@dataclass(frozen=True)
class AdapterInfo:
    """What a checkpoint holds, as one node's spec sees it."""

    rank: int
    unmapped: tuple[str, ...] = ()
    misfits: Mapping[str, str] = field(default_factory=dict)
    targets: frozenset[str] = frozenset()


@dataclass(frozen=True, eq=False)
class LoraSpec:
    """One node's view of the model (a language model, a vision tower) for LoRA.

    patterns are (regex, target, slice) triples: a regex fully matching a checkpoint's module
    name, with a group named layer where the target repeats per layer; slice None where the
    module covers every slice of its target (a qkv_proj fused in the base model). convert_keys
    reads a checkpoint's whole key list into (module, role) per key, so it can tell a layout
    from the file itself; conversions that compare equal read a checkpoint alike.
    """

    targets: Mapping[str, LoraTarget]
    max_rank: int
    patterns: tuple[tuple[str, str, Slices | PerExpert], ...] = ()
    capacity: int = 8
    dtype: torch.dtype = field(default_factory=bfloat16)
    adapters: Mapping[str, str] = field(default_factory=dict)
    convert_keys: ConvertKeys = field(default_factory=lambda: peft_keys)
    name: str = "language_model"

    def __post_init__(self) -> None:
        if self.max_rank < 1:
            raise ValueError(f"max_rank must be positive, not {self.max_rank}")
        if self.capacity < 1:
            raise ValueError(f"capacity must be positive, not {self.capacity}")
        for _, target, _ in self.patterns:
            if target not in self.targets:
                raise ValueError(f"a pattern names target {target!r}, which the spec lacks")

    @cached_property
    def _compiled(self) -> tuple[tuple[re.Pattern[str], str, Slices | PerExpert], ...]:
        return tuple((re.compile(p), t, s) for p, t, s in self.patterns)

    @cached_property
    def _located(self) -> dict[str, Location | None]:
        return {}

    def _matches(self, module: str) -> Iterator[tuple[dict[str, str | None], str, Slices | PerExpert]]:
        """The first pattern that matches module whole, as (its groups, target, slice): by one regex joining
        them all, each alternative in order (a regex tries them so, so the first that matches whole is the
        first pattern that does, with the same groups), else one pattern after another."""
        joined = self._joined
        if joined is None:
            for regex, target, s in self._compiled:
                m = regex.fullmatch(module)
                if m:
                    yield m.groupdict(), target, s
                    return
            return
        m = joined.fullmatch(module)
        if m:
            i = int(m.lastgroup[2:])
            _, target, s = self.patterns[i]
            yield {name: m.group(group) for name, group in self._groups[i].items()}, target, s

    @cached_property
    def _groups(self) -> tuple[dict[str, str], ...]:
        """Each pattern's named groups, by their names in the joined regex."""
        return tuple({name: f"{name}__{i}" for name in regex.groupindex} for i, (regex, _, _) in
                     enumerate(self._compiled))

    @cached_property
    def _joined(self) -> re.Pattern[str] | None:
        parts = []
        for i, (pattern, _, _) in enumerate(self.patterns):
            if "(?P=" in pattern or re.search(r"\\[1-9]|\\g", pattern) or "__" in pattern:
                return None  # a reference to a group, which joining renames or renumbers
            renamed = re.sub(r"\(\?P<(\w+)>", lambda m, i=i: f"(?P<{m.group(1)}__{i}>", pattern)
            parts.append(f"(?P<__{i}>{renamed})")
        try:
            return re.compile("|".join(parts)) if parts else None
        except re.error:  # a pattern whose flags apply to all of it, say
            return None

    def locate(self, module: str) -> Location | None:
        """(target, layer, slice) of a checkpoint module name, or None if no target maps it."""
        try:
            return self._located[module]
        except KeyError:
            pass
        found = None
        for indices, target, s in self._matches(module):
            layer, expert = indices.get("layer") or "0", indices.get("expert") or "0"
            if not (canonical_index(layer) and canonical_index(expert)):
                break  # layers.01 or layers.١ is a name PEFT never writes, and no module has
            if isinstance(s, PerExpert):
                s = int(expert) * s.per + s.offset
            row = self.targets[target].row(int(layer))
            found = None if row is None else Location(target, row, s)
            if found is not None and (s is None or type(s) is int or all(type(x) is int for x in s)):
                untrack((found,))  # a name and integers: in no cycle (acyclic.py); spec's cache keeps it
            break
        if len(self._located) < 1 << 20:  # adapters of one model share their module names
            self._located[module] = found
        return found

    def locate_all(self, modules: Sequence[str]) -> list[Location | None]:
        """locate of each module, in order: those located before (adapters of one model share their names)
        looked up in one pass, the rest located one by one."""
        found = list(map(self._located.get, modules, repeat(_UNSEEN)))
        if _UNSEEN in found:
            found = [self.locate(m) if loc is _UNSEEN else loc for m, loc in zip(modules, found, strict=True)]
        return found

    def check_world(self, world_size: int) -> None:
        """Raise ValueError naming the first target that cannot shard over world_size ranks."""
        for name, target in self.targets.items():
            try:
                target.check(world_size)
            except ValueError as e:
                raise ValueError(f"{self.name} target {name!r}: {e}") from None
