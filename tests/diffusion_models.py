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
