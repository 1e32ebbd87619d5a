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
# The linears outside the blocks, by their native names: the condition embedders and the head.
TOP_NATIVE = {
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "head.head": "proj_out",
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
        # Outside the blocks, each used once a step: replicated, as a rank reads their outputs whole.
        "time_embedder_1": LoraTarget(1, config["freq_dim"], (dim,), "replicated"),
        "time_embedder_2": LoraTarget(1, dim, (dim,), "replicated"),
        "time_proj": LoraTarget(1, dim, (6 * dim,), "replicated"),
        "text_embedder_1": LoraTarget(1, config["text_dim"], (dim,), "replicated"),
        "text_embedder_2": LoraTarget(1, dim, (dim,), "replicated"),
        "proj_out": LoraTarget(1, dim, ((config.get("out_channels") or config["in_channels"]) * math.prod(patch),),
                               "replicated"),
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
        (r"condition_embedder\.time_embedder\.linear_1", "time_embedder_1", None),
        (r"condition_embedder\.time_embedder\.linear_2", "time_embedder_2", None),
        (r"condition_embedder\.time_proj", "time_proj", None),
        (r"condition_embedder\.text_embedder\.linear_1", "text_embedder_1", None),
        (r"condition_embedder\.text_embedder\.linear_2", "text_embedder_2", None),
        (r"proj_out", "proj_out", None),
    ]
    if config.get("image_dim"):
        image = config["image_dim"]
        targets["image_embedder_1"] = LoraTarget(1, image, (image,), "replicated")
        targets["image_embedder_2"] = LoraTarget(1, image, (dim,), "replicated")
        patterns += [(r"condition_embedder\.image_embedder\.ff\.net\.0\.proj", "image_embedder_1", None),
                     (r"condition_embedder\.image_embedder\.ff\.net\.2", "image_embedder_2", None)]
    if config.get("added_kv_proj_dim"):
        targets["cross_img_kv"] = LoraTarget(layers, config["added_kv_proj_dim"], (dim, dim), "column", (heads, heads))
        patterns += [(BLOCK + r"attn2\.add_k_proj", "cross_img_kv", 0),
                     (BLOCK + r"attn2\.add_v_proj", "cross_img_kv", 1)]
    keys = WanKeys(layers)
    return {"transformer": LoraSpec(targets, patterns=tuple(patterns), name="transformer", convert_keys=keys, **kw)}


@dataclass(frozen=True)
class WanKeys:
    """Wan LoRA keys onto diffusers' module names, the layout told from each key: diffusers / PEFT
    (transformer.blocks.0.attn1.to_q.lora_A.weight), the Wan trainers'
    (diffusion_model.blocks.0.self_attn.q.lora_down.weight, .alpha), DiffSynth-Studio's
    (pipe.dit.blocks.0.self_attn.q.lora_A.default.weight) and kohya / musubi / VideoX-Fun's
    (lora_unet_blocks_0_self_attn_q.lora_down.weight), whose underscores are resolved against the
    model's own module names, never guessed."""

    layers: int

    def __call__(self, keys: Sequence[str]) -> dict[str, tuple[str, str]]:
        out = {}
        for key in keys:
            module, role = trainer_key(key, flat_names(self.layers))
            out[key] = (to_diffusers(module), role)
        return out


def to_diffusers(native: str) -> str:
    """A Wan trainer's module name as diffusers names it; any other (diffusers' own) is left as it is."""
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", native)
    if m and m.group(2) in NATIVE:
        return f"blocks.{m.group(1)}.{NATIVE[m.group(2)]}"
    return TOP_NATIVE.get(native, native)


@functools.lru_cache(maxsize=16)
def flat_names(layers: int) -> dict[str, str]:
    """Every module name of a Wan model with this many blocks, its own and diffusers', keyed by its
    _-joined form."""
    names = ["patch_embedding", *TOP_NATIVE, *TOP_NATIVE.values()]
    names += [f"blocks.{i}.{n}" for i in range(layers) for native in NATIVE.items() for n in native]
    return {n.replace(".", "_"): n for n in names}
