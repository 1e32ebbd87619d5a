"""The FLUX transformer (diffusers' FluxTransformer2DModel) and the LoRA layouts it ships in.

Targets follow the fusions BFL's own implementation makes, which is what an engine runs: in a
double-stream block the image and the text stream each have one q/k/v (column, by heads), an
output projection (row) and an MLP (column then row); in a single-stream block q, k, v and the
MLP's input are one linear (linear1: column, q/k/v by heads and the MLP slice by rows). Three
linears stay replicated: the adaLN modulations, whose outputs are read whole by every rank,
and a single block's linear2, whose input concatenates attention and MLP outputs, so equal
input chunks would not be any rank's shard. The embedders and the final projection are
replicated too.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..keys import trainer_key
from ..spec import LoraSpec, LoraTarget

DOUBLE = r"(?:transformer_blocks|double_blocks)\.(?P<layer>\d+)\."
SINGLE = r"(?:single_transformer_blocks|single_blocks)\.(?P<layer>\d+)\."

# (diffusers name after the block prefix, BFL's name, target, slice); a BFL fused module covers
# every slice of its target.
DOUBLE_MODULES = (
    ("attn.to_q", None, "img_qkv", 0), ("attn.to_k", None, "img_qkv", 1), ("attn.to_v", None, "img_qkv", 2),
    (None, "img_attn.qkv", "img_qkv", None),
    ("attn.add_q_proj", None, "txt_qkv", 0), ("attn.add_k_proj", None, "txt_qkv", 1),
    ("attn.add_v_proj", None, "txt_qkv", 2), (None, "txt_attn.qkv", "txt_qkv", None),
    ("attn.to_out.0", "img_attn.proj", "img_out", None),
    ("attn.to_add_out", "txt_attn.proj", "txt_out", None),
    ("ff.net.0.proj", "img_mlp.0", "img_mlp_up", None), ("ff.net.2", "img_mlp.2", "img_mlp_down", None),
    ("ff_context.net.0.proj", "txt_mlp.0", "txt_mlp_up", None),
    ("ff_context.net.2", "txt_mlp.2", "txt_mlp_down", None),
    ("norm1.linear", "img_mod.lin", "img_mod", None), ("norm1_context.linear", "txt_mod.lin", "txt_mod", None),
)
SINGLE_MODULES = (
    ("attn.to_q", None, "single_linear1", 0), ("attn.to_k", None, "single_linear1", 1),
    ("attn.to_v", None, "single_linear1", 2), ("proj_mlp", None, "single_linear1", 3),
    (None, "linear1", "single_linear1", None),
    ("proj_out", "linear2", "single_linear2", None),
    ("norm.linear", "modulation.lin", "single_mod", None),
)
TOP_MODULES = (("x_embedder", "img_in", "x_embedder"), ("context_embedder", "txt_in", "context_embedder"),
               ("proj_out", "final_layer.linear", "proj_out"))


def _escape(name: str) -> str:
    return name.replace(".", r"\.")


def flux_specs(config: Mapping[str, Any], **kw: Any) -> dict[str, LoraSpec]:
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    dim, mlp = heads * head_dim, 4 * heads * head_dim
    double, single = config["num_layers"], config["num_single_layers"]
    in_channels = config.get("in_channels", 64)
    out_channels = (config.get("out_channels") or in_channels) * config.get("patch_size", 1) ** 2
    qkv = (dim, dim, dim)
    targets = {
        "img_qkv": LoraTarget(double, dim, qkv, "column", (heads,) * 3),
        "txt_qkv": LoraTarget(double, dim, qkv, "column", (heads,) * 3),
        "img_out": LoraTarget(double, dim, (dim,), "row"),
        "txt_out": LoraTarget(double, dim, (dim,), "row"),
        "img_mlp_up": LoraTarget(double, dim, (mlp,), "column"),
        "img_mlp_down": LoraTarget(double, mlp, (dim,), "row"),
        "txt_mlp_up": LoraTarget(double, dim, (mlp,), "column"),
        "txt_mlp_down": LoraTarget(double, mlp, (dim,), "row"),
        "img_mod": LoraTarget(double, dim, (6 * dim,), "replicated"),
        "txt_mod": LoraTarget(double, dim, (6 * dim,), "replicated"),
        "single_linear1": LoraTarget(single, dim, (dim, dim, dim, mlp), "column", (heads, heads, heads, None)),
        "single_linear2": LoraTarget(single, dim + mlp, (dim,), "replicated"),
        "single_mod": LoraTarget(single, dim, (3 * dim,), "replicated"),
        "x_embedder": LoraTarget(1, in_channels, (dim,), "replicated"),
        "context_embedder": LoraTarget(1, config["joint_attention_dim"], (dim,), "replicated"),
        "proj_out": LoraTarget(1, dim, (out_channels,), "replicated"),
    }
    patterns = []
    for block, modules in ((DOUBLE, DOUBLE_MODULES), (SINGLE, SINGLE_MODULES)):
        for ours, bfl, target, s in modules:
            names = "|".join(_escape(n) for n in (ours, bfl) if n)
            patterns.append((f"{block}(?:{names})", target, s))
    for ours, bfl, target in TOP_MODULES:
        patterns.append((f"(?:{_escape(ours)}|{_escape(bfl)})", target, None))
    keys = FluxKeys(double, single)
    return {"transformer": LoraSpec(targets, patterns=tuple(patterns), name="transformer", convert_keys=keys, **kw)}


@dataclass(frozen=True)
class FluxKeys:
    """FLUX LoRA keys onto module names the spec locates: diffusers / PEFT
    (transformer.transformer_blocks.0.attn.to_q.lora_A.weight), BFL's
    (diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight, fused) and kohya's
    (lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight, .alpha), whose underscores are
    resolved against BFL's module names for this model, never guessed."""

    double: int
    single: int

    def __call__(self, keys: Sequence[str]) -> dict[str, tuple[str, str]]:
        names = bfl_names(self.double, self.single)
        return {key: trainer_key(key, names)[:2] for key in keys}


@functools.lru_cache(maxsize=16)
def bfl_names(double: int, single: int) -> dict[str, str]:
    """BFL's module names of a FLUX model this size, keyed by their _-joined form."""
    names = [bfl for _, bfl, _ in TOP_MODULES]
    names += [f"double_blocks.{i}.{bfl}" for i in range(double) for _, bfl, _, _ in DOUBLE_MODULES if bfl]
    names += [f"single_blocks.{i}.{bfl}" for i in range(single) for _, bfl, _, _ in SINGLE_MODULES if bfl]
    return {n.replace(".", "_"): n for n in names}
