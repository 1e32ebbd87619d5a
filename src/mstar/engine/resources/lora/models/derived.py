"""Each node's LoraSpec derived from the model itself, so that an architecture needs no code here.

The tree (sites.py) gives every linear, conv, router and stacked expert parameter, the layers that have it
and its widths; the plan (by default transformers' own tp_plan) says column or row, and what it does not
name is replicated; the rules (rules.py) add what neither says: heads, fused siblings, multi-projection
linears. Nodes: "experts" holds the stacked experts (its own max_rank), "vision_tower" what a vision
config built, "language_model" the rest.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..keys import peft_keys
from ..spec import Experts, LoraSpec, LoraTarget, Parallel
from . import rules
from .sites import Site, sites


@dataclass(frozen=True)
class Group:
    """One weight across the layers that have it: its sites, alike but for their layer."""

    sites: tuple[Site, ...]
    node: str
    parallel: Parallel

    @property
    def first(self) -> Site:
        return self.sites[0]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(s.layer for s in self.sites if s.layer is not None)


def specs_from_model(
    model: nn.Module,
    *,
    max_rank: int,
    tp_plan: Mapping[str, str] | None = None,
    capacity: int = 8,
    adapters: Mapping[str, str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    max_expert_rank: int | None = None,
    fuse: Sequence[Sequence[str]] = rules.FUSED,
) -> dict[str, LoraSpec]:
    """Each node's LoraSpec for model (the engine's own, or a transformers model built on the meta device
    from its config). tp_plan is the engine's tensor-parallel plan in transformers' form (default the
    model's own tp_plan; {} replicates every target); fuse lists the sibling groups the engine computes as
    one matmul (() for an engine that fuses none). The output embeddings are no target."""
    plan = rules.Plan(rules.default_plan(model) if tp_plan is None else tp_plan)
    skip = _output_names(model)
    groups = _groups([s for s in sites(model) if s.name not in skip], plan)
    lengths = {n: len(m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    keys = WrappedKeys(_wrapped(groups))
    kw = {"capacity": capacity, "adapters": dict(adapters or {}), "dtype": dtype, "convert_keys": keys}
    specs = {}
    for node in dict.fromkeys(g.node for g in groups):
        mine = [g for g in groups if g.node == node]
        targets, patterns = _targets(mine, fuse, lengths)
        rank = (max_expert_rank or max_rank) if node == "experts" else max_rank
        specs[node] = LoraSpec(targets, rank, patterns=tuple(patterns), name=node, **kw)
    return specs or {"language_model": LoraSpec({}, max_rank, name="language_model", **kw)}


def _output_names(model: nn.Module) -> set[str]:
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else None
    return {n for n, m in model.named_modules() if out is not None and m is out}


def _node(s: Site) -> str:
    if s.kind == "stacked":
        return "experts"
    return "vision_tower" if "Vision" in type(s.config).__name__ else "language_model"


def _groups(found: list[Site], plan: rules.Plan) -> list[Group]:
    by: dict[tuple, list[Site]] = {}
    for s in found:
        by.setdefault((s.template, s.kind, s.in_features, s.out_features, s.kernel, s.experts), []).append(s)
    return [Group(tuple(ss), _node(ss[0]), _parallel(ss[0], plan)) for ss in by.values()]


def _parallel(s: Site, plan: rules.Plan) -> Parallel:
    """s's sharding as the plan says; by whole heads (unit_colwise) only where its heads are the units."""
    if plan.by_units(s.name) and (s.kind != "linear" or rules.is_packed(s.leaf)
                                  or rules.unit_heads(s.config, s.leaf, s.out_features) is None):
        return "replicated"
    return plan.parallel(s.name, _transposed(s))


def _transposed(s: Site) -> bool:
    return s.experts is not None and s.experts.layout == "in_out"


def _targets(groups: list[Group], fuse: Sequence[Sequence[str]], lengths: Mapping[str, int]):
    """The node's targets and patterns: fused groups first, then each other group on its own."""
    targets: dict[str, LoraTarget] = {}
    patterns: list[tuple[str, str, int | None]] = []
    taken: set[int] = set()
    buckets: dict[tuple, dict[str, int]] = {}
    for i, g in enumerate(groups):
        s = g.first
        if s.kind == "linear" and not rules.is_packed(s.leaf):
            buckets.setdefault((s.prefix, s.parent, g.layers, s.in_features, g.parallel), {})[s.leaf] = i
    for bucket in buckets.values():
        for fused in rules.fusions(list(bucket), fuse):
            members = [groups[bucket[leaf]] for leaf in fused]
            taken.update(bucket[leaf] for leaf in fused)
            _add(targets, patterns, members, lengths)
    for i, g in enumerate(groups):
        if i not in taken:
            _add(targets, patterns, [g], lengths)
    return targets, patterns


def _add(targets: dict[str, LoraTarget], patterns: list, members: list[Group], lengths: Mapping[str, int]) -> None:
    first = members[0]
    s = first.first
    widths, heads, parallel = _slices(members)
    layers = first.layers
    ids = None
    if s.layer is not None and layers != tuple(range(lengths.get(s.prefix[:-1], 0))):
        ids = layers
    experts = None
    if s.experts is not None:
        e = s.experts
        experts = Experts(e.count, e.layout, e.interleaved)
        widths = (s.out_features // e.per,) * (e.per * e.count)
    target = LoraTarget(max(len(layers), 1), s.in_features, widths, parallel, heads, s.kernel, experts, ids)
    name = _name(members)
    if name in targets:  # one weight at two widths (a model whose layers differ): each its own target
        name = f"{name}@{layers[0]}"
    targets[name] = target
    layer = r"\d+" if ids is None else "|".join(map(str, ids))
    for i, g in enumerate(members):
        m = g.first
        regex = re.escape(m.suffix) if m.layer is None else (
            re.escape(m.prefix) + f"(?P<layer>{layer})" + re.escape("." + m.suffix))
        patterns.append((regex, name, i if len(members) > 1 else None))


def _slices(members: list[Group]) -> tuple[tuple[int, ...], tuple[int | None, ...] | None, Parallel]:
    """Each member's width and, for a column target, its heads; a multi-projection linear's slices where
    its config gives them, else it whole and replicated."""
    parallel = members[0].parallel
    s = members[0].first
    if len(members) == 1 and s.kind == "linear" and rules.is_packed(s.leaf):
        known = rules.packed_slices(s.config, s.leaf, s.in_features, s.out_features)
        if known is None:
            return (s.out_features,), None, "replicated"
        widths, heads = known
        return widths, (heads if parallel == "column" and any(heads) else None), parallel
    widths = tuple(g.first.out_features for g in members)
    if parallel != "column" or s.kind == "stacked":
        return widths, None, parallel
    heads = tuple(rules.heads(g.first.config, g.first.leaf, g.first.out_features) for g in members)
    return widths, (heads if any(heads) else None), parallel


def _name(members: list[Group]) -> str:
    s = members[0].first
    if len(members) == 1:
        return s.template
    leaves = "+".join(g.first.leaf for g in members)
    return s.template.removesuffix(s.leaf) + leaves


def _wrapped(groups: list[Group]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(regex of a module's name, its stacked parameters in the order its class defines them) for each
    module holding stacked experts."""
    params: dict[tuple[str, str], list[str]] = {}
    for g in groups:
        s = g.first
        if s.kind == "stacked":
            module, _, pname = s.suffix.rpartition(".")
            params.setdefault((s.prefix, module), []).append(pname)
    out = []
    for (prefix, module), names in params.items():
        regex = re.escape(prefix) + r"\d+\." + re.escape(module) if prefix else re.escape(module)
        out.append((regex, tuple(names)))
    return tuple(out)


@dataclass(frozen=True)
class WrappedKeys:
    """PEFT's keys, each stacked parameter's LoRA named after the parameter (mlp.experts.gate_up_proj). PEFT
    wraps a module's targeted parameters in the order its class defines them, the first innermost
    (mlp.experts.base_layer) and the last outermost (mlp.experts). Where the keys wrap fewer parameters
    than the class stacks, which is which is not in the keys: the module keeps PEFT's name, which no
    target maps, so it is refused by name rather than guessed."""

    modules: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __call__(self, keys: Sequence[str]) -> dict[str, tuple[str, str]]:
        read = peft_keys(keys)
        if not self.modules:
            return read
        depths: dict[str, set[int]] = {}
        for module, _ in read.values():
            base, depth = _unwrap(module)
            if self._params(base):
                depths.setdefault(base, set()).add(depth)
        out = {}
        for key, (module, role) in read.items():
            base, depth = _unwrap(module)
            params = self._params(base)
            if params and depths[base] == set(range(len(params))):
                module = f"{base}.{params[len(params) - 1 - depth]}"
            out[key] = (module, role)
        return out

    def _params(self, module: str) -> tuple[str, ...]:
        for regex, params in self.modules:
            if re.fullmatch(regex, module):
                return params
        return ()


def _unwrap(module: str) -> tuple[str, int]:
    depth = 0
    while module.endswith(".base_layer"):
        module, depth = module.removesuffix(".base_layer"), depth + 1
    return module, depth
