"""The FLUX transformer (diffusers' FluxTransformer2DModel) and the LoRA layouts it ships in.

Targets follow the fusions BFL's own implementation makes, which is what an engine runs: in a
double-stream block the image and the text stream each have one q/k/v (column, by heads), an
output projection (row) and an MLP (column then row); in a single-stream block q, k, v and the
MLP's input are one linear (linear1: column, q/k/v by heads and the MLP slice by rows). Three
linears stay replicated: the adaLN modulations, whose outputs are read whole by every rank,
and a single block's linear2, whose input concatenates attention and MLP outputs, so equal
input chunks would not be any rank's shard. The embedders (image, text, timestep, pooled text,
guidance), the final adaLN and the final projection are replicated too. The final adaLN's output
is scale then shift, as diffusers has it; BFL's holds shift then scale, so its B is read in that
order.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..keys import split_key, trainer_key
from ..spec import LoraSpec, LoraTarget

DOUBLE = r"(?:transformer_blocks|double_blocks)\.(?P<layer>\d+)\."
SINGLE = r"(?:single_transformer_blocks|single_blocks)\.(?P<layer>\d+)\."

# (names of the module after the block prefix, target, slices): diffusers' name, BFL's (fused where it
# covers every slice), XLabs' (processor.*); slices as LoraTarget.covered reads them.
DOUBLE_MODULES = (
    (("attn.to_q",), "img_qkv", 0), (("attn.to_k",), "img_qkv", 1), (("attn.to_v",), "img_qkv", 2),
    (("img_attn.qkv", "processor.qkv_lora1"), "img_qkv", None),
    (("attn.add_q_proj",), "txt_qkv", 0), (("attn.add_k_proj",), "txt_qkv", 1), (("attn.add_v_proj",), "txt_qkv", 2),
    (("txt_attn.qkv", "processor.qkv_lora2"), "txt_qkv", None),
    (("attn.to_out.0", "img_attn.proj", "processor.proj_lora1"), "img_out", None),
    (("attn.to_add_out", "txt_attn.proj", "processor.proj_lora2"), "txt_out", None),
    (("ff.net.0.proj", "img_mlp.0"), "img_mlp_up", None), (("ff.net.2", "img_mlp.2"), "img_mlp_down", None),
    (("ff_context.net.0.proj", "txt_mlp.0"), "txt_mlp_up", None),
    (("ff_context.net.2", "txt_mlp.2"), "txt_mlp_down", None),
    (("norm1.linear", "img_mod.lin"), "img_mod", None), (("norm1_context.linear", "txt_mod.lin"), "txt_mod", None),
)
SINGLE_MODULES = (
    (("attn.to_q",), "single_linear1", 0), (("attn.to_k",), "single_linear1", 1),
    (("attn.to_v",), "single_linear1", 2), (("proj_mlp",), "single_linear1", 3),
    (("linear1",), "single_linear1", None), (("processor.qkv_lora",), "single_linear1", (0, 1, 2)),
    (("proj_out", "linear2", "processor.proj_lora"), "single_linear2", None),
    (("norm.linear", "modulation.lin"), "single_mod", None),
)
TOP_MODULES = (
    (("x_embedder", "img_in"), "x_embedder", None),
    (("context_embedder", "txt_in"), "context_embedder", None),
    (("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"), "time_embedder_1", None),
    (("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"), "time_embedder_2", None),
    (("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"), "text_embedder_1", None),
    (("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"), "text_embedder_2", None),
    (("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"), "guidance_embedder_1", None),
    (("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer"), "guidance_embedder_2", None),
    (("norm_out.linear",), "norm_out", None), (("final_layer.adaLN_modulation.1",), "norm_out", (1, 0)),
    (("proj_out", "final_layer.linear"), "proj_out", None),
)


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
        "time_embedder_1": LoraTarget(1, 256, (dim,), "replicated"),  # sinusoidal timesteps of 256 channels
        "time_embedder_2": LoraTarget(1, dim, (dim,), "replicated"),
        "text_embedder_1": LoraTarget(1, config.get("pooled_projection_dim", 768), (dim,), "replicated"),
        "text_embedder_2": LoraTarget(1, dim, (dim,), "replicated"),
        "norm_out": LoraTarget(1, dim, (dim, dim), "replicated"),  # scale, shift
        "proj_out": LoraTarget(1, dim, (out_channels,), "replicated"),
    }
    if config.get("guidance_embeds"):
        targets["guidance_embedder_1"] = LoraTarget(1, 256, (dim,), "replicated")
        targets["guidance_embedder_2"] = LoraTarget(1, dim, (dim,), "replicated")
    patterns = []
    for block, modules in ((DOUBLE, DOUBLE_MODULES), (SINGLE, SINGLE_MODULES), ("", TOP_MODULES)):
        for names, target, slices in modules:
            if target in targets:
                patterns.append((f"{block}(?:{'|'.join(map(_escape, names))})", target, slices))
    keys = FluxKeys(double, single)
    return {"transformer": LoraSpec(targets, patterns=tuple(patterns), name="transformer", convert_keys=keys, **kw)}


@dataclass(frozen=True)
class FluxKeys:
    """FLUX LoRA keys onto module names the spec locates: diffusers / PEFT
    (transformer.transformer_blocks.0.attn.to_q.lora_A.weight), BFL's
    (diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight, fused), XLabs'
    (double_blocks.0.processor.qkv_lora1.down.weight), and kohya's and the "mixture" trainers'
    (lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight, lora_transformer_transformer_blocks_0_
    attn_to_q.lora_down.weight, .alpha), whose underscores are resolved against BFL's and diffusers'
    module names for this model, never guessed."""

    double: int
    single: int

    def __call__(self, keys: Sequence[str]) -> dict[str, tuple[str, str]]:
        names = flat_names(self.double, self.single)
        return {key: _xlabs(key) or trainer_key(key, names) for key in keys}


def _xlabs(key: str) -> tuple[str, str] | None:
    """(module, role) of an XLabs key: its LoRA layers are processor.*_lora*, factors down and up."""
    bare = key.removeprefix("diffusion_model.")
    if ".processor." not in bare:
        return None
    for suffix, role in ((".down.weight", "A"), (".up.weight", "B")):
        if bare.endswith(suffix):
            return bare.removesuffix(suffix), role
    return split_key(bare)


@functools.lru_cache(maxsize=16)
def flat_names(double: int, single: int) -> dict[str, str]:
    """Every module name of a FLUX model this size, BFL's and diffusers', keyed by its _-joined form."""
    names = [n for names, _, _ in TOP_MODULES for n in names]
    names += [f"{block}.{i}.{n}" for block, count, modules in (
        ("double_blocks", double, DOUBLE_MODULES), ("transformer_blocks", double, DOUBLE_MODULES),
        ("single_blocks", single, SINGLE_MODULES), ("single_transformer_blocks", single, SINGLE_MODULES))
        for i in range(count) for names, _, _ in modules for n in names if not n.startswith("processor.")]
    return {n.replace(".", "_"): n for n in names}
