"""Tiny randomly initialised transformers models and the PEFT adapters they are given."""

from __future__ import annotations

import json
from pathlib import Path

import torch

LM = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "pad_token_id": 0}
LM_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VISION = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 4, "mlp_ratio": 2, "patch_size": 4,
          "temporal_patch_size": 2, "in_channels": 3, "spatial_merge_size": 2}
VISION_25 = {"depth": 2, "hidden_size": 32, "out_hidden_size": 64, "intermediate_size": 48, "num_heads": 4,
             "patch_size": 4, "temporal_patch_size": 2, "in_channels": 3, "spatial_merge_size": 2,
             "fullatt_block_indexes": [1], "window_size": 16}
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "qwen2_vl", "qwen2_5_vl"]


def model_config(arch: str, **over) -> dict:
    """A config.json dict for a tiny model of arch."""
    text = {**LM, **over}
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
        vision = VISION if arch == "qwen2_vl" else VISION_25
        text["model_type"] = arch + "_text"
        tokens = {"image_token_id": 120, "video_token_id": 121,
                  "vision_start_token_id": 122, "vision_end_token_id": 123}
        return {"model_type": arch, "text_config": text, "vision_config": dict(vision), **tokens}
    return {"model_type": arch, **text}


def build_model(config: dict, seed: int = 0) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(**config)
    if config["model_type"] == "qwen2_vl":
        return transformers.Qwen2VLForConditionalGeneration(cfg).eval()
    if config["model_type"] == "qwen2_5_vl":
        return transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def randomize_lora(model: torch.nn.Module, seed: int = 1) -> None:
    """Give every lora_B random values: PEFT starts it at zero, which would hide any error."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def make_adapter(tmp: Path, arch: str = "llama", name: str = "ad", seed: int = 1, config: dict | None = None,
                 dtype: torch.dtype = torch.float32, **lora) -> tuple[torch.nn.Module, Path]:
    """A PEFT adapter saved by PEFT itself for a tiny model of arch, its factors in dtype (PEFT would cast them to
    float32, autocast_adapter_dtype, and a "bf16" adapter would be an fp32 file); (the peft model, its dir). The
    model holds the very values the file does, so deltas computed from it are the file's."""
    import peft

    config = config or model_config(arch)
    model = build_model(config).to(dtype)
    lora.setdefault("target_modules", LM_TARGETS if arch != "phi3" else ["qkv_proj", "o_proj", "gate_up_proj",
                                                                         "down_proj"])
    lora.setdefault("r", 4)
    lora.setdefault("lora_alpha", 8)
    pm = peft.get_peft_model(model, peft.LoraConfig(**lora), autocast_adapter_dtype=False)
    randomize_lora(pm, seed)
    path = tmp / name
    pm.save_pretrained(path)
    saved = saved_dtypes(path)
    assert saved == {SAFETENSORS_DTYPES[dtype]}, f"PEFT saved {saved}, not {dtype}"
    return pm.eval(), path


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def saved_dtypes(path: Path) -> set[str]:
    """The dtypes (as safetensors spells them) of the tensors in an adapter dir's safetensors file, from its header."""
    with open(path / "adapter_model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {e["dtype"] for k, e in header.items() if k != "__metadata__"}


def write_config(tmp: Path, config: dict, name: str = "config.json") -> Path:
    p = tmp / name
    p.write_text(json.dumps(config))
    return p
