"""Tiny random diffusers transformers, adapters saved by diffusers itself, and diffusers' own loading."""

from __future__ import annotations

from inspect import signature
from pathlib import Path

import torch

WAN = {"_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": 2,
       "attention_head_dim": 8, "in_channels": 4, "out_channels": 4, "text_dim": 16, "freq_dim": 16, "ffn_dim": 32,
       "num_layers": 2, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
       "image_dim": None, "added_kv_proj_dim": None, "rope_max_seq_len": 32}
WAN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


FLUX = {"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 8, "num_layers": 1,
        "num_single_layers": 1, "attention_head_dim": 8, "num_attention_heads": 2, "joint_attention_dim": 16,
        "pooled_projection_dim": 16, "guidance_embeds": False, "axes_dims_rope": [2, 2, 4]}
FLUX_TARGETS = ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out",
                "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "norm1.linear",
                "norm1_context.linear", "proj_mlp", "proj_out", "norm.linear", "x_embedder", "context_embedder",
                "timestep_embedder.linear_1", "timestep_embedder.linear_2", "text_embedder.linear_1",
                "text_embedder.linear_2", "norm_out.linear"]
# model config -> (the transformer's class, the pipeline whose LoRA loader reads its files, default targets)
KINDS = {"WanTransformer3DModel": ("WanPipeline", WAN_TARGETS), "FluxTransformer2DModel": ("FluxPipeline",
                                                                                            FLUX_TARGETS)}


def transformer(config: dict, seed: int = 0) -> torch.nn.Module:
    """A tiny random diffusers transformer of config's class."""
    import diffusers

    torch.manual_seed(seed)
    cls = getattr(diffusers, config["_class_name"])
    return cls(**{k: v for k, v in config.items() if not k.startswith("_")}).eval()


def pipeline(config: dict):
    import diffusers

    return getattr(diffusers, KINDS[config["_class_name"]][0])


def save_lora(config: dict, path: Path, seed: int = 1, **lora) -> Path:
    """A LoRA added to a tiny transformer through diffusers and saved with its save_lora_weights."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from tiny import randomize_lora

    lora.setdefault("r", 4)
    lora.setdefault("lora_alpha", 8)
    lora.setdefault("target_modules", KINDS[config["_class_name"]][1])
    model = transformer(config)
    lora_config = LoraConfig(**lora)
    model.add_adapter(lora_config)
    randomize_lora(model, seed)
    pipeline(config).save_lora_weights(path, transformer_lora_layers=get_peft_model_state_dict(model),
                                       transformer_lora_adapter_metadata=lora_config.to_dict())
    return path / "pytorch_lora_weights.safetensors"


def loaded(config: dict, file: Path) -> torch.nn.Module:
    """A fresh tiny transformer with the LoRA file loaded the way diffusers' pipelines load it."""
    model = transformer(config)
    pipe = pipeline(config)
    state, metadata = pipe.lora_state_dict(str(file), return_lora_metadata=True)
    takes_alphas = "network_alphas" in signature(pipe.load_lora_into_transformer).parameters
    extra = {"network_alphas": None} if takes_alphas else {}
    pipe.load_lora_into_transformer(state, transformer=model, metadata=metadata, **extra)
    return model


def save_wan_lora(path: Path, seed: int = 1, **lora) -> Path:
    return save_lora(WAN, path, seed, **lora)


def save_flux_lora(path: Path, seed: int = 1, **lora) -> Path:
    return save_lora(FLUX, path, seed, **lora)


def native(diffusers_file: Path, path: Path, style: str, alphas: bool = True, alpha_dtype=torch.float32) -> Path:
    """A diffusers Wan file's weights in a trainer's layout ("native" or "kohya"), each module with
    its own alpha."""
    from safetensors.torch import load_file, save_file

    from mstar.engine.resources.lora.models.wan import NATIVE, TOP_NATIVE

    to_native = {v: k for k, v in NATIVE.items()}
    top = {v: k for k, v in TOP_NATIVE.items()}
    out = {}
    for i, (key, value) in enumerate(sorted(load_file(diffusers_file).items())):
        module, _, role = key.removeprefix("transformer.").rpartition(".lora_")
        if module in top:
            name = top[module]
        else:
            _, block, rest = module.split(".", 2)
            name = f"blocks.{block}.{to_native[rest]}"
        down_up = {"A.weight": "lora_down.weight", "B.weight": "lora_up.weight"}[role]
        prefix = f"lora_unet_{name.replace('.', '_')}" if style == "kohya" else f"diffusion_model.{name}"
        out[f"{prefix}.{down_up}"] = value
        if alphas and role == "A.weight":
            out[f"{prefix}.alpha"] = torch.tensor(value.shape[0] * (0.5 + 0.25 * (i % 5))).to(alpha_dtype)
    save_file(out, path)
    return path
