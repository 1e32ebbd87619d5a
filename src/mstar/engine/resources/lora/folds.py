"""How a node's modules' scalings go into its slots: one scaling for the node, which the slots take, and
each module's own as a ratio folded into its B in float32 before the cast (per module, or over a target's
whole b at once). It follows from the modules' scalings alone, which the digest covers, so one digest is
always one layout; a plan works it out once per distinct set of scalings (Plan.folds)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


class FoldRow(NamedTuple):
    """One B read whose module folds a ratio: rows b_to on of b[layer] of its target, its first r columns,
    scaled from its rows staged at offset `at` (nbytes of dtype), or in place where `at` is -1."""

    target: str
    layer: int
    b_to: int
    height: int
    r: int
    at: int
    nbytes: int
    dtype: torch.dtype
    ratio: float


class Folds(NamedTuple):
    """The slots' scaling, and each module's own scaling as a ratio to it, folded into B in float32 before
    the cast: per module, or over a target's whole b where every module of it has one ratio and was
    copied exactly. A plan adds the rows of the reads it folds (dense targets' staged B, B read in place),
    so a read follows them without a look at the plan's table."""

    scaling: float
    ratios: dict[str, float]
    whole: dict[str, float]
    staged_rows: tuple[FoldRow, ...] = ()
    direct_rows: tuple[FoldRow, ...] = ()


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


def fold(scalings: Mapping[str, float], modules: Sequence[str], owners: Iterable[tuple[str, str, bool]]) -> Folds:
    """How modules' scalings go into the slots: the node's scaling, and the rest as ratios folded into B,
    per module or over a target's whole b. owners: (module, its target, whether it was copied exactly, in
    the store's dtype), as the plan placed them."""
    scaling = node_scaling(scalings, modules)
    ratios = {m: scalings[m] / scaling for m in modules if scalings[m] != scaling}
    if not ratios:  # every module at the node's scaling (an expert node at a rank of its own): nothing folds
        return Folds(scaling, {}, {})
    # Targets whose every module has one ratio and was copied exactly (in the store's dtype) fold their
    # whole b in place at once: a Qwen3-MoE adapter's experts at a rank of their own, 55,000 folds become one.
    seen: dict[str, set[tuple[float, bool]]] = {}
    for module, target, exact in owners:
        seen.setdefault(target, set()).add((ratios.get(module, 1.0), exact))
    whole = {}
    for target, kinds in seen.items():
        if len(kinds) == 1:
            ((ratio, exact),) = kinds
            if exact and ratio != 1.0:
                whole[target] = ratio
    ratios = {m: r for m, t, _ in owners if (r := ratios.get(m)) is not None and t not in whole}
    return Folds(scaling, ratios, whole)
