"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral, gpt-oss): attention as a decoder's, and the experts as
a node of their own.

The "experts" node has its own max_rank (expert LoRA is trained at a rank far below the attention's).
Its two targets keep the seed's layout with experts as slices, expert-major: experts_gate_up is column
parallel, slices gate_0, up_0, gate_1, up_1, ... (each slice's rows shard), and experts_down is row
parallel, one slice per expert (A's input columns, the intermediate width, shard). So a[t] is
[layers, E * k * R, in], a view away from the [layers, E, k * R, in] an expert kernel gathers by routed
expert. Expert parallelism is a later step: expert-major order makes each rank's experts one range.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import itemgetter, methodcaller
from typing import Any

from ..keys import peft_keys
from ..spec import Experts, LoraSpec, LoraTarget, PerExpert
from .decoder import lm_patterns, lm_targets

LAYER = r"model\.layers\.(?P<layer>\d+)\."


@dataclass(frozen=True)
class Family:
    """What tells one MoE family's checkpoints apart: its config's intermediate width field, where its
    per-expert modules live and what they are called, and how it stores the stacked experts."""

    intermediate_field: str
    per_expert: str  # the module path of expert {e}'s linears, after the layer prefix
    gate: str
    up: str
    down: str
    layout: str = "out_in"
    interleaved: bool = False
    router: str = r"mlp\.gate"  # the router's module, an [experts, hidden] weight served as a linear's


FAMILIES = {
    # transformers 4 named Qwen3-MoE's experts mlp.experts.{e}.gate_proj ...; 5 stacks them in mlp.experts
    "qwen3_moe": Family("moe_intermediate_size", r"mlp\.experts", "gate_proj", "up_proj", "down_proj"),
    # Mixtral's were block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down)
    "mixtral": Family("intermediate_size", r"block_sparse_moe\.experts", "w1", "w3", "w2",
                      router=r"(?:mlp|block_sparse_moe)\.gate"),
    # gpt-oss has only ever stacked them, as [E, in, out], gate and up interleaved
    "gpt_oss": Family("intermediate_size", r"mlp\.experts", "gate_proj", "up_proj", "down_proj", "in_out", True,
                      r"mlp\.router"),
}
# The expert count's names: the Hub's Qwen3-MoE configs say num_experts, Mixtral's, gpt-oss's and every
# family's saved by transformers 5 num_local_experts. Any family's config may carry either.
COUNT_FIELDS = ("num_experts", "num_local_experts")


def expert_count(config: Mapping[str, Any]) -> int:
    """The config's expert count under whichever name it has; ValueError where it has none, or two that differ."""
    named = {f: config[f] for f in COUNT_FIELDS if config.get(f) is not None}
    if not named:
        raise ValueError(f"config names no expert count ({' or '.join(COUNT_FIELDS)}), which its architecture needs")
    for f, v in named.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"config's {f} {v!r} is not a positive expert count")
    if len(set(named.values())) > 1:
        raise ValueError("config's " + " and ".join(f"{f} {v}" for f, v in named.items())
                         + " differ: which is the model's expert count cannot be told")
    return next(iter(named.values()))


def moe_specs(config: Mapping[str, Any], family: str, *, max_rank: int, max_expert_rank: int | None = None,
              **kw: Any) -> dict[str, LoraSpec]:
    """The "language_model" node (attention and the router) and the "experts" node of a mixture-of-experts decoder."""
    f = FAMILIES[family]
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise ValueError("layers with a dense MLP beside the expert layers are not served yet")
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    count, inter = expert_count(config), config[f.intermediate_field]
    keys = MoeKeys()
    attention = {n: t for n, t in lm_targets({**config, "intermediate_size": inter}).items()
                 if n in ("qkv_proj", "o_proj")}
    attention["router"] = LoraTarget(layers, hidden, (count,), "replicated")
    patterns = (*(p for p in lm_patterns(False) if p[1] in attention), (LAYER + f.router, "router", None))
    lm = LoraSpec(attention, max_rank, patterns=patterns, name="language_model", convert_keys=keys, **kw)
    experts = Experts(count, f.layout, f.interleaved)  # type: ignore[arg-type]
    targets = {
        "experts_gate_up": LoraTarget(layers, hidden, (inter,) * (2 * count), "column", experts=experts),
        "experts_down": LoraTarget(layers, inter, (hidden,) * count, "row", experts=experts),
    }
    expert = LAYER + f.per_expert + r"\.(?P<expert>\d+)\."
    patterns = (
        (expert + re.escape(f.gate), "experts_gate_up", PerExpert(2, 0)),
        (expert + re.escape(f.up), "experts_gate_up", PerExpert(2, 1)),
        (expert + re.escape(f.down), "experts_down", PerExpert(1, 0)),
        (LAYER + r"mlp\.experts\.gate_up_proj", "experts_gate_up", None),  # every expert's, stacked
        (LAYER + r"mlp\.experts\.down_proj", "experts_down", None),
    )
    rank = max_expert_rank or max_rank
    return {"language_model": lm,
            "experts": LoraSpec(targets, rank, patterns=patterns, name="experts", convert_keys=keys, **kw)}


@dataclass(frozen=True)
class MoeKeys:
    """PEFT's keys, with the stacked experts' LoRA named after the parameter it adapts. PEFT wraps the
    experts' parameters in the order the experts class defines them, gate_up_proj first, so it is the
    inner wrapper (mlp.experts.base_layer) and down_proj the outer (mlp.experts)."""

    def __call__(self, keys: Sequence[str]) -> dict[str, tuple[str, str]]:
        out = peft_keys(keys)
        stacked = map(methodcaller("endswith", (".mlp.experts.base_layer", ".mlp.experts")), map(itemgetter(0),
                                                                                                 out.values()))
        for key in list(compress(out, stacked)):  # the few stacked modules, renamed where they are
            module, role = out[key]
            if module.endswith(".mlp.experts.base_layer"):
                module = module.removesuffix("base_layer") + "gate_up_proj"
            else:
                module += ".down_proj"
            out[key] = (module, role)
        return out
