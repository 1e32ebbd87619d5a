"""A diffusers pipeline's nodes, from its folder (model_index.json, unet/ or transformer/, text_encoder*/) or
from its denoiser's config alone: the denoiser, derived from the diffusers model (diffusion.py), and, where
the folder has them, each text encoder, derived from the transformers model its config builds, locating its
modules under its component's name (text_encoder.text_model.encoder.layers.0.self_attn.q_proj), as the
pipeline's LoRA files name them."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..json_file import read_json
from ..spec import LoraSpec
from . import meta
from .derived import specs_from_model
from .diffusion import diffusion_spec, meta_model
from .diffusion_keys import TEXT_ENCODERS, DiffusersKeys

INDEX = "model_index.json"
DENOISERS = ("unet", "transformer")


def is_pipeline(config: Any) -> bool:
    try:
        return isinstance(config, (str, Path)) and (Path(config) / INDEX).is_file()
    except OSError:
        return False


def denoiser_config(folder: str | Path) -> Path:
    """The pipeline's denoiser's config file."""
    found = [Path(folder) / d / "config.json" for d in DENOISERS if (Path(folder) / d / "config.json").is_file()]
    if not found:
        raise ValueError(f"diffusers pipeline {folder}: neither unet/config.json nor transformer/config.json")
    return found[0]


def with_text_encoders(folder: str | Path, denoiser: dict[str, LoraSpec], **kw: Any) -> dict[str, LoraSpec]:
    """The denoiser's nodes (its own builder's or derived), then one per text encoder the folder has, each
    derived from the transformers model its config builds; the derived denoiser then reads those encoders'
    keys as theirs, where without them it refuses them by name."""
    folder = Path(folder)
    texts = tuple(t for t in TEXT_ENCODERS if (folder / t / "config.json").is_file())
    node, spec = next(iter(denoiser.items()))
    keys = spec.convert_keys
    if isinstance(keys, DiffusersKeys):
        keys = dataclasses.replace(keys, text_encoders=texts)
        denoiser = {**denoiser, node: dataclasses.replace(spec, convert_keys=keys)}
    else:  # a hand-written builder's conversion: the encoders' nodes read their own keys
        keys = DiffusersKeys(node, frozenset(), texts)
    specs = dict(denoiser)
    for text in texts:
        source = str(folder / text / "config.json")
        specs[text] = text_encoder_spec(meta.meta_model(_read(source), source), text, keys, **kw)
    return specs


def denoiser_specs(raw: Mapping[str, Any], source: str, **kw: Any) -> dict[str, LoraSpec]:
    """The one node of a denoiser's config alone: its text encoders' keys are refused by name."""
    spec = diffusion_spec(meta_model(raw, source), **kw)
    return {spec.name: spec}


def text_encoder_spec(model: Any, node: str, keys: Any, **kw: Any) -> LoraSpec:
    """A text encoder's node: its derived spec, locating its modules under the component's name."""
    kw.pop("max_expert_rank", None)
    spec = next(iter(specs_from_model(model, **kw).values()))
    patterns = tuple((re.escape(f"{node}.") + p, t, s) for p, t, s in spec.patterns)
    return dataclasses.replace(spec, patterns=patterns, name=node, convert_keys=keys)


def _read(path: str) -> dict[str, Any]:
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ValueError(f"model config {path}: not a JSON object")
    return raw
