"""LoRA specs built from a Hugging Face config.json, one per node of the model."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..spec import LoraSpec
from .decoder import decoder_spec, phi3_spec
from .flux import flux_specs
from .moe import FAMILIES, moe_specs
from .qwen2_vl import qwen2_5_vl_specs, qwen2_vl_specs
from .wan import wan_specs

PRESETS = Path(__file__).parent / "presets"

Builder = Callable[..., dict[str, LoraSpec]]


def _decoder(config: Mapping[str, Any], **kw: Any) -> dict[str, LoraSpec]:
    return {"language_model": decoder_spec(config, **kw)}


def _phi3(config: Mapping[str, Any], **kw: Any) -> dict[str, LoraSpec]:
    return {"language_model": phi3_spec(config, **kw)}


def _moe(family: str) -> Builder:
    def build(config: Mapping[str, Any], **kw: Any) -> dict[str, LoraSpec]:
        return moe_specs(config, family, **kw)

    return build


BUILDERS: dict[str, Builder] = {
    "llama": _decoder,
    "mistral": _decoder,
    "qwen2": _decoder,
    "qwen3": _decoder,
    "gemma": _decoder,
    "gemma2": _decoder,
    "phi3": _phi3,
    "qwen2_vl": qwen2_vl_specs,
    "qwen2_5_vl": qwen2_5_vl_specs,
    "wan": wan_specs,
    "flux": flux_specs,
    **{family: _moe(family) for family in FAMILIES},  # these builders take max_expert_rank
}

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Phi3ForCausalLM": "phi3",
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "WanTransformer3DModel": "wan",
    "FluxTransformer2DModel": "flux",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
}


def presets() -> list[str]:
    """The names of the built-in model configs."""
    return sorted(p.stem for p in PRESETS.glob("*.json"))


def load_config(config: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """A config dict from a dict, a JSON file's path, or a built-in preset's name."""
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    if not path.is_file() and (PRESETS / f"{config}.json").is_file():
        path = PRESETS / f"{config}.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{config}: neither a config file nor a preset ({', '.join(presets())})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config}: not a JSON object")
    return raw


def model_type(config: Mapping[str, Any]) -> str:
    """The architecture a config names, by model_type or else its architectures list."""
    mt = config.get("model_type")
    if mt in BUILDERS:
        return mt
    for arch in [config.get("_class_name"), *(config.get("architectures") or ())]:  # diffusers: _class_name
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    named = mt or ", ".join(config.get("architectures") or ()) or "none"
    raise ValueError(f"unknown architecture {named!r}; known: {', '.join(sorted(BUILDERS))}")


def specs_from_config(
    config: str | os.PathLike[str] | Mapping[str, Any],
    *,
    max_rank: int,
    capacity: int = 8,
    adapters: Mapping[str, str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    max_expert_rank: int | None = None,
) -> dict[str, LoraSpec]:
    """Each node's LoraSpec, keyed "language_model" and, for a vision-language model,
    "vision_tower" ("transformer" for a diffusion transformer; "experts", with max_expert_rank,
    default max_rank, for a mixture of experts); every node serves the same adapters."""
    raw = load_config(config)
    kind = model_type(raw)
    extra = {"max_expert_rank": max_expert_rank} if kind in FAMILIES else {}
    try:
        return BUILDERS[kind](raw, max_rank=max_rank, capacity=capacity, adapters=dict(adapters or {}), dtype=dtype,
                              **extra)
    except KeyError as e:
        raise ValueError(f"config lacks {e.args[0]!r}, which its architecture needs") from None
