"""Tiny configs of the diffusers models served through their derived spec, the models themselves (random, from
diffusers' own classes) and a pipeline's folder of their configs, as diffusers and transformers save them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# SDXL's UNet as its config sets it up (text_time added conditioning, linear projections, a transformer depth
# per block), shrunk.
SDXL_UNET = {"_class_name": "UNet2DConditionModel", "sample_size": 8, "in_channels": 4, "out_channels": 4,
             "block_out_channels": [32, 64], "layers_per_block": 1, "norm_num_groups": 8,
             "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
             "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "cross_attention_dim": 32,
             "attention_head_dim": [2, 4], "use_linear_projection": True, "transformer_layers_per_block": [1, 2],
             "addition_embed_type": "text_time", "addition_time_embed_dim": 8,
             "projection_class_embeddings_input_dim": 80}
SD3 = {"_class_name": "SD3Transformer2DModel", "sample_size": 8, "patch_size": 2, "in_channels": 4,
       "num_layers": 2, "attention_head_dim": 8, "num_attention_heads": 2, "caption_projection_dim": 16,
       "joint_attention_dim": 16, "pooled_projection_dim": 16, "out_channels": 4}
FLUX2 = {"_class_name": "Flux2Transformer2DModel", "patch_size": 1, "in_channels": 8, "num_layers": 1,
         "num_single_layers": 1, "attention_head_dim": 8, "num_attention_heads": 2, "joint_attention_dim": 16,
         "timestep_guidance_channels": 8, "axes_dims_rope": [2, 2, 2, 2]}
QWEN_IMAGE = {"_class_name": "QwenImageTransformer2DModel", "patch_size": 2, "in_channels": 16, "out_channels": 4,
              "num_layers": 2, "attention_head_dim": 8, "num_attention_heads": 2, "joint_attention_dim": 16,
              "axes_dims_rope": [2, 2, 4]}
HUNYUAN_VIDEO = {"_class_name": "HunyuanVideoTransformer3DModel", "in_channels": 4, "out_channels": 4,
                 "num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 1, "num_single_layers": 1,
                 "num_refiner_layers": 1, "patch_size": 1, "patch_size_t": 1, "text_embed_dim": 16,
                 "pooled_projection_dim": 8, "rope_axes_dim": [2, 2, 4]}
LTX_VIDEO = {"_class_name": "LTXVideoTransformer3DModel", "in_channels": 8, "out_channels": 8, "patch_size": 1,
             "patch_size_t": 1, "num_attention_heads": 2, "attention_head_dim": 8, "cross_attention_dim": 16,
             "num_layers": 2, "caption_channels": 16}
MODELS = {"sdxl": SDXL_UNET, "sd3": SD3, "flux2": FLUX2, "qwen_image": QWEN_IMAGE, "hunyuan_video": HUNYUAN_VIDEO,
          "ltx_video": LTX_VIDEO}
# The UNet's convs by the names PEFT matches (a downsampler's and upsampler's is "conv").
UNET_CONVS = ["conv_in", "conv1", "conv2", "conv_shortcut", "conv", "conv_out"]
# A CLIP text encoder as SDXL's two are, shrunk.
CLIP = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "vocab_size": 64, "max_position_embeddings": 16, "projection_dim": 16}


def model(config: dict, seed: int = 0) -> torch.nn.Module:
    """A tiny random diffusers model of config's class, float32."""
    import diffusers

    torch.manual_seed(seed)
    return getattr(diffusers, config["_class_name"])(**{k: v for k, v in config.items() if k[0] != "_"}).eval()


def text_encoder(projection: bool = False, seed: int = 0) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    cls = transformers.CLIPTextModelWithProjection if projection else transformers.CLIPTextModel
    return cls(transformers.CLIPTextConfig(**CLIP)).eval()


def sdxl_folder(path: Path, text_encoders: bool = True) -> Path:
    """A pipeline's folder of configs as save_pretrained writes it (no weights: the spec reads configs alone)."""
    import diffusers

    path.mkdir(parents=True, exist_ok=True)
    components = {"unet": ["diffusers", "UNet2DConditionModel"]}
    model(SDXL_UNET).save_config(path / "unet")
    if text_encoders:
        for name, projection in (("text_encoder", False), ("text_encoder_2", True)):
            encoder = text_encoder(projection)
            encoder.config.architectures = [type(encoder).__name__]  # as a model's save_pretrained writes it
            encoder.config.save_pretrained(path / name)
            components[name] = ["transformers", "CLIPTextModelWithProjection" if projection else "CLIPTextModel"]
    index = {"_class_name": "StableDiffusionXLPipeline", "_diffusers_version": diffusers.__version__, **components}
    (path / "model_index.json").write_text(json.dumps(index))
    return path


# Each transformer's pipeline, whose LoRA loader reads its files.
PIPELINES = {"SD3Transformer2DModel": "StableDiffusion3Pipeline", "Flux2Transformer2DModel": "Flux2Pipeline",
             "QwenImageTransformer2DModel": "QwenImagePipeline",
             "HunyuanVideoTransformer3DModel": "HunyuanVideoPipeline", "LTXVideoTransformer3DModel": "LTXPipeline"}


def peft_state(module: torch.nn.Module, seed: int = 1, **lora) -> dict[str, torch.Tensor]:
    """PEFT's adapter injected into module (every linear by default), its factors random: its state dict."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    lora.setdefault("target_modules", "all-linear")
    lora.setdefault("r", 4)
    lora.setdefault("lora_alpha", 4)
    inject_adapter_in_model(LoraConfig(**lora), module)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return get_peft_model_state_dict(module)


def pipeline(config: dict):
    import diffusers

    return getattr(diffusers, PIPELINES[config["_class_name"]])


def diffusers_loaded(config: dict, file: Path) -> torch.nn.Module:
    """A fresh tiny transformer with file loaded as config's pipeline loads a LoRA into it."""
    from inspect import signature

    transformer, pipe = model(config), pipeline(config)
    state, metadata = pipe.lora_state_dict(str(file), return_lora_metadata=True)
    extra = {"network_alphas": None} if "network_alphas" in signature(pipe.load_lora_into_transformer).parameters \
        else {}
    pipe.load_lora_into_transformer(state, transformer=transformer, metadata=metadata, **extra)
    return transformer
