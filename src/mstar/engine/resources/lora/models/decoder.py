"""Decoder-only language models (Llama, Mistral, Qwen2/3, Gemma/2, Phi-3)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..spec import LoraSpec, LoraTarget

# The layer prefixes a language model's modules have had, newest first: a vision-language
# model nests it under model.language_model, a causal LM under model.
LM_PREFIXES = (r"model\.language_model\.layers", r"model\.layers")


def lm_targets(config: Mapping[str, Any]) -> dict[str, LoraTarget]:
    """The four fused linears of a transformer decoder layer, with GQA heads for qkv_proj."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    qkv = (heads * head_dim, kv * head_dim, kv * head_dim)
    return {
        "qkv_proj": LoraTarget(layers, hidden, qkv, "column", (heads, kv, kv)),
        "o_proj": LoraTarget(layers, heads * head_dim, (hidden,), "row"),
        "gate_up_proj": LoraTarget(layers, hidden, (inter, inter), "column"),
        "down_proj": LoraTarget(layers, inter, (hidden,), "row"),
    }


def lm_patterns(fused: bool) -> tuple[tuple[str, str, int | None], ...]:
    """Module-name patterns of a decoder layer; fused where the base model already fuses qkv and gate/up."""
    per_layer: list[tuple[str, str, int | None]] = [
        (r"self_attn\.o_proj", "o_proj", None),
        (r"mlp\.down_proj", "down_proj", None),
    ]
    if fused:
        per_layer += [(r"self_attn\.qkv_proj", "qkv_proj", None), (r"mlp\.gate_up_proj", "gate_up_proj", None)]
    else:
        per_layer += [
            (r"self_attn\.q_proj", "qkv_proj", 0),
            (r"self_attn\.k_proj", "qkv_proj", 1),
            (r"self_attn\.v_proj", "qkv_proj", 2),
            (r"mlp\.gate_proj", "gate_up_proj", 0),
            (r"mlp\.up_proj", "gate_up_proj", 1),
        ]
    prefix = "(?:" + "|".join(LM_PREFIXES) + r")\.(?P<layer>\d+)\."
    return tuple((prefix + p, t, s) for p, t, s in per_layer)


def decoder_spec(config: Mapping[str, Any], *, fused: bool = False, **kw: Any) -> LoraSpec:
    return LoraSpec(lm_targets(config), patterns=lm_patterns(fused), name="language_model", **kw)


def phi3_spec(config: Mapping[str, Any], **kw: Any) -> LoraSpec:
    return decoder_spec(config, fused=True, **kw)
