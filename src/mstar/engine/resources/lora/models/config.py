"""A model's config as a dict, from whatever names it: a dict, a transformers PretrainedConfig, a config JSON
file, a model folder or a built-in preset. Imports no torch, so the command line can name the presets in
its --help at once."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..json_file import read_json

PRESETS = Path(__file__).parent / "presets"
CONFIG_FILE = "config.json"  # what transformers' and diffusers' save_pretrained write in a model's folder


def presets() -> list[str]:
    """The names of the built-in model configs."""
    return sorted(p.stem for p in PRESETS.glob("*.json"))


def config_file(config: str | os.PathLike[str]) -> Path:
    """The JSON file a path or preset name stands for: the file itself, a model folder's config.json
    (a diffusers pipeline's transformer/config.json), or the preset's file."""
    path = Path(config)
    try:
        is_dir = path.is_dir()
    except OSError as e:  # a name over NAME_MAX, say
        raise ValueError(f"model config {path}: unreadable ({e.strerror or e})") from None
    if is_dir:
        for inner in (path / CONFIG_FILE, path / "transformer" / CONFIG_FILE, path / "unet" / CONFIG_FILE):
            if os.path.lexists(inner):
                return inner
        raise ValueError(f"model folder {path}: no {CONFIG_FILE} in it (nor transformer/{CONFIG_FILE} or "
                         f"unet/{CONFIG_FILE}, as a diffusers pipeline has)")
    if os.path.lexists(path):
        return path
    if os.fspath(config) in presets():
        return PRESETS / f"{os.fspath(config)}.json"
    raise ValueError(f"{os.fspath(config)}: neither a config file, a model folder nor a preset "
                     f"({', '.join(presets())})")


def read_model_config(config: Any) -> tuple[dict[str, Any], str]:
    """(the config as a dict, what to call it in a message)."""
    if isinstance(config, Mapping):
        return dict(config), "model config"
    if not isinstance(config, (str, os.PathLike)):
        to_dict = getattr(config, "to_dict", None)  # a transformers PretrainedConfig, without importing transformers
        if not callable(to_dict):
            raise ValueError(f"a model config is a path, a preset's name, a dict or a transformers PretrainedConfig, "
                             f"not {type(config).__name__}")
        raw, source = to_dict(), f"model config ({type(config).__name__})"
    else:
        path = config_file(config)
        source = f"preset {path.stem!r}" if path.parent == PRESETS else f"model config {path}"
        try:
            raw = read_json(path)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: not a JSON object")
    return raw, source


def load_config(config: Any) -> dict[str, Any]:
    """A config dict from a dict, a transformers PretrainedConfig, a JSON file's path, a model folder (its
    config.json) or a built-in preset's name."""
    return read_model_config(config)[0]


# Each architecture by the class name a config may give instead of its model_type, and so every architecture
# the builders (build.py) serve.
ARCHITECTURES = {
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


def model_type(config: Mapping[str, Any]) -> str:
    """The architecture a config names, by model_type or else its architectures list."""
    mt = config.get("model_type")
    if isinstance(mt, str) and mt in ARCHITECTURES.values():
        return mt
    archs = config.get("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    for arch in [config.get("_class_name"), *archs]:  # diffusers: _class_name
        if isinstance(arch, str) and arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    named = mt or ", ".join(archs) or "none"
    raise ValueError(f"unknown architecture {named!r}; known: {', '.join(sorted(set(ARCHITECTURES.values())))}")
