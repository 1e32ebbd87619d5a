"""Qwen2-VL and Qwen2.5-VL: a decoder language model and a ViT vision tower."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..spec import LoraSpec, LoraTarget
from .decoder import decoder_spec

# Where the vision tower's modules have been named: model.visual in current transformers,
# visual at the top in checkpoints saved before the language model moved under model.
VISION_PREFIX = r"(?:model\.visual|visual)"


def vision_spec(vision: Mapping[str, Any], *, swiglu: bool, **kw: Any) -> LoraSpec:
    """The tower's blocks (fused qkv column by heads, proj row, MLP column then row), its
    patch embedding, a Conv3d whose kernel is its stride, and the merger's two linears, replicated
    on every rank. Qwen2.5-VL's blocks have a gated MLP (swiglu) where Qwen2-VL's have fc1 / fc2."""
    dim = vision["hidden_size"] if swiglu else vision["embed_dim"]
    depth, heads = vision["depth"], vision["num_heads"]
    kernel = (vision.get("temporal_patch_size", 2), vision["patch_size"], vision["patch_size"])
    channels = vision.get("in_channels") or vision.get("in_chans", 3)  # Qwen2-VL's own files say in_chans
    targets = {
        "qkv": LoraTarget(depth, dim, (dim, dim, dim), "column", (heads, heads, heads)),
        "proj": LoraTarget(depth, dim, (dim,), "row"),
        "patch_embed": LoraTarget(1, channels * math.prod(kernel), (dim,), "replicated", kernel=kernel),
    }
    block = VISION_PREFIX + r"\.blocks\.(?P<layer>\d+)\."
    patterns = [
        (block + r"attn\.qkv", "qkv", None),
        (block + r"attn\.proj", "proj", None),
        (VISION_PREFIX + r"\.patch_embed\.proj", "patch_embed", None),
    ]
    # The merger's MLP, once after the blocks: its input is spatial_merge_size**2 patches' features side by side.
    merged = dim * vision.get("spatial_merge_size", 2) ** 2
    merged_out = vision["out_hidden_size"] if swiglu else vision["hidden_size"]
    targets["merger_fc1"] = LoraTarget(1, merged, (merged,), "replicated")
    targets["merger_fc2"] = LoraTarget(1, merged, (merged_out,), "replicated")
    patterns += [(VISION_PREFIX + r"\.merger\.mlp\.0", "merger_fc1", None),
                 (VISION_PREFIX + r"\.merger\.mlp\.2", "merger_fc2", None)]
    if swiglu:
        inter = vision["intermediate_size"]
        targets["gate_up_proj"] = LoraTarget(depth, dim, (inter, inter), "column")
        targets["down_proj"] = LoraTarget(depth, inter, (dim,), "row")
        patterns += [
            (block + r"mlp\.gate_proj", "gate_up_proj", 0),
            (block + r"mlp\.up_proj", "gate_up_proj", 1),
            (block + r"mlp\.down_proj", "down_proj", None),
        ]
    else:
        inter = int(dim * vision.get("mlp_ratio", 4))
        targets["fc1"] = LoraTarget(depth, dim, (inter,), "column")
        targets["fc2"] = LoraTarget(depth, inter, (dim,), "row")
        patterns += [(block + r"mlp\.fc1", "fc1", None), (block + r"mlp\.fc2", "fc2", None)]
    return LoraSpec(targets, patterns=tuple(patterns), name="vision_tower", **kw)


def qwen2_vl_specs(config: Mapping[str, Any], *, swiglu: bool = False, **kw: Any) -> dict[str, LoraSpec]:
    # transformers 5 nests the language model's fields under text_config; older files keep them on top.
    text = config.get("text_config") or config
    vision = vision_spec(config["vision_config"], swiglu=swiglu, **kw)
    return {"language_model": decoder_spec(text, **kw), "vision_tower": vision}


def qwen2_5_vl_specs(config: Mapping[str, Any], **kw: Any) -> dict[str, LoraSpec]:
    return qwen2_vl_specs(config, swiglu=True, **kw)
