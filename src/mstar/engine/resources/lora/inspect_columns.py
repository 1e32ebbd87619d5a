"""The inspection of a header whose modules are all plain A / B pairs, judged in passes over columns.

A per-expert MoE adapter is tens of thousands of modules of a handful of templates, every one an A and a B
that fit: judging each module by itself is most of a cold read. Here every module's shapes, place and rule
are taken as columns, each distinct (target, slice, shapes) judged once, and the answer is the one
check.py's walk gives, or None wherever a module is not plain or any one misfits: the walk then judges
them all and names each misfit, so no refusal's words come from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import compress, repeat
from operator import attrgetter, eq, is_not, itemgetter, methodcaller, not_
from typing import TYPE_CHECKING, Any, NamedTuple

from .spec import AdapterInfo, Location, LoraSpec

if TYPE_CHECKING:
    from .adapter_config import AdapterConfig, ModuleRule
    from .keys import ModuleKeys

_FLOATS = frozenset({"F32", "F16", "BF16"})
_ORIENTED = frozenset({"A in", "A out"})


class Pairs(NamedTuple):
    """Modules every one of which holds exactly an A and a B under keys of their own, none on the vocabulary,
    as columns: their names (in the modules' order) and their A's and B's values. A function of the header and
    its key conversion alone, so every node inspecting one header shares it."""

    names: list[str]
    a: list[Any]
    b: list[Any]


class Plain(NamedTuple):
    """A plain header's inspection, and its placed modules' columns: names, places and A's and B's values."""

    info: AdapterInfo
    names: list[str]
    places: list[Location]
    a: list[Any]
    b: list[Any]


_AB = frozenset({"A", "B"})


def plain_pairs(modules: Mapping[str, ModuleKeys], vocab: tuple[str, ...]) -> Pairs | None:
    """modules as Pairs where every one is a plain pair off the vocabulary (its names, vocab, as a module or a
    dotted ending); None otherwise. Taken as group_keys found them where it did (keys.Grouped.ab), else from
    each module's roles."""
    ab = getattr(modules, "ab", None)
    if ab is not None:
        names, a, b = ab
    else:
        names, keys = list(modules), list(modules.values())
        if any(map(attrgetter("doubled"), keys)):
            return None
        roles = list(map(attrgetter("roles"), keys))
        if not all(map(eq, repeat(_AB), map(dict.keys, roles))):  # exactly A and B: a set against each's keys
            return None
        a, b = list(map(itemgetter("A"), roles)), list(map(itemgetter("B"), roles))
    ending = tuple(f".{m}" for m in vocab)
    if any(map(methodcaller("endswith", ending), names)) or not set(vocab).isdisjoint(names):
        return None
    return Pairs(names, a, b)


def plain_info(spec: LoraSpec, pairs: Pairs | None, shape: Callable[[Any], tuple[int, ...]],
               judge: Callable[..., str | None]) -> Plain | None:
    """check._inspect's answer where the modules are plain pairs (pairs, not None) and none misfits (judge,
    misfit_at, says so of each distinct place and shapes) or fills weights another fills; None otherwise."""
    if pairs is None:
        return None
    names = pairs.names
    locs = spec.locate_all(names)
    mask = list(map(is_not, locs, repeat(None)))
    placed = list(compress(locs, mask))
    a, b = list(compress(pairs.a, mask)), list(compress(pairs.b, mask))
    kinds = set(zip(map(attrgetter("target", "slice"), placed), map(tuple, map(shape, a)),
                    map(tuple, map(shape, b)), strict=True))
    if not _fit(spec, placed, kinds, judge) or not _apart(spec, placed):
        return None
    rank = max((module_rank(spec, Location(t, 0, s), sa) for (t, s), sa, _ in kinds), default=0)
    unmapped = tuple(sorted(compress(names, map(not_, mask))))
    info = AdapterInfo(rank, unmapped, {}, frozenset(map(attrgetter("target"), placed)))
    return Plain(info, list(compress(names, mask)), placed, a, b)


def module_rank(spec: LoraSpec, loc: Location | None, a_shape: Sequence[int]) -> int:
    """A module's rank: A's rows, or per expert where A stacks every expert's."""
    r = a_shape[0] if a_shape else 0
    if loc is not None and loc.slice is None:
        experts = spec.targets[loc.target].experts
        if experts is not None:
            return r // experts.count
    return r


def _fit(spec: LoraSpec, placed: list[Location], kinds: set, judge: Callable[..., str | None]) -> bool:
    """Whether no placed module misfits: each on one of its target's layers, and each distinct ((target,
    slice), A's shape, B's shape) of kinds judged once, a module's layer counting for nothing else in
    misfit_at."""
    if any(layer >= spec.targets[t].layers for t, layer in set(map(attrgetter("target", "layer"), placed))):
        return False
    return all(judge(spec, Location(t, 0, s), sa, sb) is None for (t, s), sa, sb in kinds)


def _apart(spec: LoraSpec, placed: list[Location]) -> bool:
    """Whether no two placed modules fill one (target, layer, slice)."""
    covered = {(t, s): spec.targets[t].covered(s) for t, s in set(map(attrgetter("target", "slice"), placed))}
    if all(cover == (s,) for (_, s), cover in covered.items()):  # one slice each: its own place
        return len(set(placed)) == len(placed)
    cells = [(loc.target, loc.layer, sl) for loc in placed for sl in covered[loc.target, loc.slice]]
    return len(set(cells)) == len(cells)


def plain_header(spec: LoraSpec, plain: Plain, config: AdapterConfig | None, rules: Mapping[str, ModuleRule],
                 ways: Mapping[str, object]) -> bool:
    """Whether check._inspect_header's walk, after plain_info's answer (plain, of a header's entries), finds
    nothing more: every placed module's factors floats of one dtype, its rank the config's, its orientation
    known (ways holds placed modules alone), and the config's layers and targets taking it."""
    dtypes = set(zip(map(attrgetter("dtype"), plain.a), map(attrgetter("dtype"), plain.b), strict=True))
    if any(da not in _FLOATS or db != da for da, db in dtypes) or not set(ways.values()) <= _ORIENTED:
        return False
    if config is None:
        return True
    places = map(attrgetter("target", "slice"), plain.places)
    given = map(attrgetter("rank", "targeted"), map(rules.__getitem__, plain.names))
    for (t, s), shape, (rank, targeted) in set(zip(places, map(attrgetter("shape"), plain.a), given, strict=True)):
        if not targeted or module_rank(spec, Location(t, 0, s), shape) != rank:
            return False
    return not config.layers_to_transform or all(map(config.transforms_layer, plain.names))
