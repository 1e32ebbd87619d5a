"""The rules that say what a model's tree and plan leave unsaid, written once for every architecture: how a
plan's style shards, which siblings an engine fuses, which linears hold several projections, and the heads
a slice shards by."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

from ..spec import Parallel

# Siblings an engine computes as one matmul, in the order their outputs are stacked. A group is fused when
# every member is there, under one parent, on the same layers, reading the same input width and sharded alike
# (engines fuse q/k/v and gate/up, shared experts' too; vLLM's packed_modules_mapping lists the same).
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"), ("query", "key", "value"))
# Names of a slice sharded by the query's heads (MLA's q_b_proj and kv_b_proj hold one row block per query
# head) and by the key/value heads.
QUERY = {"q_proj", "query", "q", "wq", "q_b_proj", "kv_b_proj", "to_q"}
KEY_VALUE = {"k_proj", "v_proj", "key", "value", "k", "v", "wk", "wv", "to_k", "to_v"}
# Linears holding several projections. Their slices are taken only where the config's widths give them
# exactly (q, k, v by heads; gate, up by the intermediate size); any other is one whole slice, replicated,
# never split by a guess (Qwen3-Next's in_proj_qkvz, Mamba's in_proj).
PACKED = re.compile(r".*(qkv|gate_up|query_key_value|in_proj|c_attn|w13).*", re.IGNORECASE)
PACKED_QKV = {"qkv_proj", "qkv", "wqkv", "query_key_value", "c_attn"}
PACKED_GATE_UP = {"gate_up_proj", "w13"}


def style_parallel(style: str | None) -> Parallel:
    """transformers' tensor-parallel style as the layout's: its colwise and rowwise kinds shard, every other
    (replicated_*, gather, the expert-parallel ones) and none at all replicate, which is always correct."""
    if style is None:
        return "replicated"
    if style.startswith("unit_"):  # whole heads a rank (5.25's unit_colwise on k/v): see unit_heads
        return "column" if style == "unit_colwise" else "replicated"
    kind = style.removeprefix("local_").removeprefix("packed_")
    if kind.startswith("colwise"):
        return "column"
    if kind.startswith("rowwise"):
        return "row"
    return "replicated"


class Plan:
    """A tensor-parallel plan ({"model.layers.*.self_attn.q_proj": "colwise", ...}, transformers' tp_plan
    form) asked for one weight's sharding; a weight it does not name is replicated."""

    def __init__(self, plan: Mapping[str, str]) -> None:
        self.plan = dict(plan)

    @cached_property
    def _compiled(self) -> list[tuple[re.Pattern[str], str]]:
        return [(re.compile(re.escape(k).replace(r"\*", r"\d+")), v) for k, v in self.plan.items()]

    def style(self, name: str) -> str | None:
        for regex, style in self._compiled:
            if regex.fullmatch(name):
                return style
        return None

    def by_units(self, name: str) -> bool:
        """Whether name's style shards by whole heads (unit_colwise), which rows alone cannot."""
        return (self.style(name) or "").startswith("unit_")

    def parallel(self, name: str, transposed: bool = False) -> Parallel:
        """name's sharding. transformers' styles name the weight's dimensions (colwise shards its second
        last, rowwise its last), so for a stacked expert parameter stored [E, in, out] (Llama 4's gate_up_proj,
        packed_rowwise) they read the other way round."""
        parallel = style_parallel(self.style(name))
        return {"column": "row", "row": "column"}.get(parallel, parallel) if transposed else parallel


def default_plan(model: Any) -> dict[str, str]:
    """transformers' own plan for model: its tp_plan (the base model's base_model_tp_plan under the model's
    prefix, with the head's _tp_plan), or {} for a model that has none. Its expert-parallel plan is not read:
    transformers 5.25 names most families' stacked experts there alone (grouped_gemm, split by expert), and
    under tensor parallelism every rank holds them whole, so they are replicated, as the model holds them."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, Mapping) and plan:
        return dict(plan)
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix and getattr(model, prefix, None) is not None and getattr(model, prefix) is not model
    return {(f"{prefix}.{k}" if inner else k): v for k, v in base.items()}


def field(config: Any, *names: str) -> int | None:
    """The first of names the config has as a positive integer."""
    for n in names:
        v = getattr(config, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def heads(config: Any, leaf: str, width: int) -> int | None:
    """The heads a column slice named leaf shards by: the query's or the key/value's, from the config,
    where they divide its width; None (rows) for any other."""
    q = field(config, "num_attention_heads", "num_heads", "n_head")
    if leaf in QUERY:
        n = q
    elif leaf in KEY_VALUE:
        n = field(config, "num_key_value_heads", "num_kv_heads", "n_head_kv") or q
    else:
        return None
    return n if n and width % n == 0 else None


def unit_heads(config: Any, leaf: str, width: int) -> int | None:
    """The heads unit_colwise shards leaf by: transformers gives each rank whole head_dim units (the config's
    head_dim, else hidden_size // num_attention_heads), replicated past their count, as the column rule
    does a slice's heads; so its heads where they are those units, else None (it stays whole)."""
    n = heads(config, leaf, width)
    q = field(config, "num_attention_heads", "num_heads", "n_head")
    hidden = field(config, "hidden_size")
    head_dim = field(config, "head_dim") or (hidden // q if q and hidden else None)
    return n if n and head_dim and width == n * head_dim else None


def packed_slices(config: Any, leaf: str, fan_in: int, width: int,
                  ) -> tuple[tuple[int, ...], tuple[int | None, ...]] | None:
    """(widths, heads) of a linear holding several projections, where the config's fields give them exactly;
    None where they do not (it stays whole). A qkv reads the hidden state, so its input width is the hidden
    size its head_dim divides, where the config names no head_dim."""
    if leaf.lower() in PACKED_QKV:
        q = field(config, "num_attention_heads", "num_heads", "n_head")
        kv = field(config, "num_key_value_heads", "num_kv_heads", "n_head_kv") or q
        head_dim = field(config, "head_dim") or (fan_in // q if q and fan_in % q == 0 else None)
        if q and head_dim and width == (q + 2 * kv) * head_dim:
            return (q * head_dim, kv * head_dim, kv * head_dim), (q, kv, kv)
    if leaf.lower() in PACKED_GATE_UP:
        inter = field(config, "intermediate_size")
        if inter and width == 2 * inter:
            return (inter, inter), (None, None)
    return None


def is_packed(leaf: str) -> bool:
    return PACKED.fullmatch(leaf) is not None


def fusions(leaves: Sequence[str], groups: Sequence[Sequence[str]] = FUSED) -> list[tuple[str, ...]]:
    """The groups of leaves (one parent's children) that fuse: every member present."""
    present = set(leaves)
    return [tuple(g) for g in groups if len(g) > 1 and set(g) <= present]
