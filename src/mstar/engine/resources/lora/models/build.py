"""Each node's LoraSpec, built from a model's config by its architecture's builder."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..spec import LoraSpec
from .config import ARCHITECTURES, model_type, read_model_config
from .decoder import decoder_spec, phi3_spec
from .fields import CheckedConfig, FieldError
from .flux import flux_specs
from .moe import FAMILIES, moe_specs
from .qwen2_vl import qwen2_5_vl_specs, qwen2_vl_specs
from .wan import wan_specs

if TYPE_CHECKING:
    import torch

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

if set(BUILDERS) != set(ARCHITECTURES.values()):
    raise ImportError("every architecture config.py names needs a builder here, and only those")


def specs_from_config(
    config: str | os.PathLike[str] | Mapping[str, Any] | Any,
    *,
    max_rank: int,
    capacity: int = 8,
    adapters: Mapping[str, str] | None = None,
    dtype: torch.dtype | None = None,
    max_expert_rank: int | None = None,
) -> dict[str, LoraSpec]:
    """Each node's LoraSpec, keyed "language_model" and, for a vision-language model,
    "vision_tower" ("transformer" for a diffusion transformer; "experts", with max_expert_rank,
    default max_rank, for a mixture of experts); every node serves the same adapters. config is a
    dict, a transformers PretrainedConfig, a config JSON file, a model folder or a preset's name.
    An architecture no builder here knows is derived from the model transformers builds from the
    config on the meta device (specs_from_model), or for a diffusers config (its _class_name) the one
    diffusers builds ("unet" or "transformer"); a diffusers pipeline's folder gives its denoiser's node
    and one per text encoder it has ("text_encoder", "text_encoder_2"). dtype is
    the specs' (default LoraSpec's, bfloat16; left out, torch is imported only once a spec is made)."""
    _positive("max_rank", max_rank)
    _positive("capacity", capacity)
    if max_expert_rank is not None:  # never `or max_rank`: 0 is a mistake, not the default
        _positive("max_expert_rank", max_expert_rank)
    kw = {"max_rank": max_rank, "capacity": capacity, "adapters": adapters, "dtype": dtype}
    if _is_pipeline(config):  # a diffusers pipeline's folder: its denoiser and text encoders
        from .pipeline import denoiser_config, with_text_encoders

        denoiser = specs_from_config(denoiser_config(config), max_expert_rank=max_expert_rank, **kw)
        return with_text_encoders(config, denoiser, **kw)
    raw, source = read_model_config(config)
    try:
        kind = model_type(CheckedConfig(raw, source))
    except FieldError:
        raise
    except ValueError:  # no builder: derived from the model diffusers or transformers builds on the meta device
        if isinstance(raw.get("_class_name"), str):
            from .pipeline import denoiser_specs

            return denoiser_specs(raw, source, **kw)
        kind = None
    if kind is None or (kind in FAMILIES and _dense_beside_experts(CheckedConfig(raw, source, kind))):
        from .derived import specs_from_model  # torch and transformers: imported only for a model derived
        from .meta import meta_model

        return specs_from_model(meta_model(raw, source), max_expert_rank=max_expert_rank, **kw)
    try:
        checked = CheckedConfig(raw, source, kind)
        extra = {"max_expert_rank": max_expert_rank} if kind in FAMILIES else {}
        return BUILDERS[kind](checked, max_rank=max_rank, capacity=capacity, adapters=dict(adapters or {}),
                              **({} if dtype is None else {"dtype": dtype}), **extra)
    except FieldError:
        raise
    except KeyError as e:
        raise ValueError(f"{source}: config lacks {e.args[0]!r}, which its architecture needs") from None
    except ValueError as e:  # the config's, as the builder found it
        raise ValueError(f"{source}: {e}") from None


def _is_pipeline(config: Any) -> bool:
    """Whether config is a diffusers pipeline's folder (its model_index.json), asked without importing the
    derivation (torch) that reads one."""
    try:
        return isinstance(config, (str, os.PathLike)) and os.path.isfile(os.path.join(config, "model_index.json"))
    except (OSError, ValueError):
        return False


def _dense_beside_experts(config: Mapping[str, Any]) -> bool:
    """Whether some layers have a dense MLP instead of experts, which the MoE builder's targets (on every
    layer) do not say and the derived spec's (on the layers holding each) do."""
    return bool(config.get("mlp_only_layers")) or config.get("decoder_sparse_step", 1) != 1


def _positive(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, not {value!r}")
