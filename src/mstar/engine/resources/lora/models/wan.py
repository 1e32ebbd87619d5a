"""The Wan 2.x video transformer (diffusers' WanTransformer3DModel) and the LoRA layouts it ships in.

Targets are the linears an engine fuses: self-attention q, k, v read one input and become one
column-parallel target sliced by heads; cross-attention q reads the video, k and v the text
(and add_k / add_v the image, in image-to-video models), so they are separate targets; the
outputs and the FFN's second linear are row-parallel. The patch embedding is a Conv3d whose
kernel is its stride, replicated on every rank.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..keys import trainer_key
from ..spec import LoraSpec, LoraTarget

BLOCK = r"blocks\.(?P<layer>\d+)\."
# A Wan trainer's module names (the original repository's) and diffusers' names for them.
NATIVE = {
    "self_attn.q": "attn1.to_q",
    "self_attn.k": "attn1.to_k",
    "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0",
    "cross_attn.q": "attn2.to_q",
    "cross_attn.k": "attn2.to_k",
    "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0",
    "cross_attn.k_img": "attn2.add_k_proj",
    "cross_attn.v_img": "attn2.add_v_proj",
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
}


def wan_specs(config: Mapping[str, Any], **kw: Any) -> dict[str, LoraSpec]:
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    dim, layers, ffn = heads * head_dim, config["num_layers"], config["ffn_dim"]
    patch = tuple(config.get("patch_size") or (1, 2, 2))
    targets = {
        "self_qkv": LoraTarget(layers, dim, (dim, dim, dim), "column", (heads, heads, heads)),
        "self_out": LoraTarget(layers, dim, (dim,), "row"),
        "cross_q": LoraTarget(layers, dim, (dim,), "column", (heads,)),
        "cross_kv": LoraTarget(layers, dim, (dim, dim), "column", (heads, heads)),
        "cross_out": LoraTarget(layers, dim, (dim,), "row"),
        "ffn_up": LoraTarget(layers, dim, (ffn,), "column"),
        "ffn_down": LoraTarget(layers, ffn, (dim,), "row"),
        "patch_embedding": LoraTarget(1, config["in_channels"] * math.prod(patch), (dim,), "replicated",
                                      kernel=patch),
    }
    patterns = [
        (BLOCK + r"attn1\.to_q", "self_qkv", 0),
        (BLOCK + r"attn1\.to_k", "self_qkv", 1),
        (BLOCK + r"attn1\.to_v", "self_qkv", 2),
        (BLOCK + r"attn1\.to_out\.0", "self_out", None),
        (BLOCK + r"attn2\.to_q", "cross_q", None),
        (BLOCK + r"attn2\.to_k", "cross_kv", 0),
        (BLOCK + r"attn2\.to_v", "cross_kv", 1),
        (BLOCK + r"attn2\.to_out\.0", "cross_out", None),
        (BLOCK + r"ffn\.net\.0\.proj", "ffn_up", None),
        (BLOCK + r"ffn\.net\.2", "ffn_down", None),
        (r"patch_embedding", "patch_embedding", None),
    ]
    if config.get("added_kv_proj_dim"):
        targets["cross_img_kv"] = LoraTarget(layers, config["added_kv_proj_dim"], (dim, dim), "column", (heads, heads))
        patterns += [(BLOCK + r"attn2\.add_k_proj", "cross_img_kv", 0),
                     (BLOCK + r"attn2\.add_v_proj", "cross_img_kv", 1)]
    keys = WanKeys(layers)
    return {"transformer": LoraSpec(targets, patterns=tuple(patterns), name="transformer", convert_keys=keys, **kw)}


@dataclass(frozen=True)
class WanKeys:
    """Wan LoRA keys onto diffusers' module names, the layout told from each key's prefix:
    diffusers / PEFT (transformer.blocks.0.attn1.to_q.lora_A.weight), the Wan trainers'
    (diffusion_model.blocks.0.self_attn.q.lora_down.weight, .alpha) and kohya / musubi's
    (lora_unet_blocks_0_self_attn_q.lora_down.weight), whose underscores are resolved against
    the model's own module names, never guessed."""

    layers: int

    def __call__(self, keys: Sequence[str]) -> dict[str, tuple[str, str]]:
        out = {}
        for key in keys:
            module, role, native = trainer_key(key, kohya_names(self.layers))
            out[key] = (to_diffusers(module) if native else module, role)
        return out


def to_diffusers(native: str) -> str:
    """A Wan trainer's module name as diffusers names it; an unknown one is left as it is."""
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", native)
    if m and m.group(2) in NATIVE:
        return f"blocks.{m.group(1)}.{NATIVE[m.group(2)]}"
    return native


@functools.lru_cache(maxsize=16)
def kohya_names(layers: int) -> dict[str, str]:
    """Every native module name of a Wan model with this many blocks, keyed by its _-joined form."""
    names = ["patch_embedding"] + [f"blocks.{i}.{n}" for i in range(layers) for n in NATIVE]
    return {n.replace(".", "_"): n for n in names}
