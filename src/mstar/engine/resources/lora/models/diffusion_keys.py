"""A diffusers pipeline's LoRA keys onto the module names its nodes locate.

diffusers' and PEFT's own layouts (unet.<name>, transformer.<name>, text_encoder.<name>, base_model.model.
<name>) and the trainers' layouts: kohya's SDXL keys (lora_unet_..., lora_te1_..., lora_te2_...) read by
diffusers' own conversion (diffusers.loaders.lora_conversion_utils, then its PEFT renames), so a name reads
as diffusers' load_lora_weights reads it; the diffusion_model.<name> and lora_unet_<name, dots as
underscores> keys of the transformers' trainers (ai-toolkit, musubi, kohya: Qwen-Image, LTX-Video, ...)
resolved against the model's own module names, never guessed. A text encoder's module keeps its
component's name (text_encoder.text_model.encoder.layers.0.self_attn.q_proj); where the deployment serves
no node for that text encoder, its keys are read as the role "text_encoder", which is refused by name.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

from ..keys import PEFT_PREFIX, split_key, trainer_key

KOHYA_TEXT = {"lora_te_": "text_encoder", "lora_te1_": "text_encoder", "lora_te2_": "text_encoder_2"}
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


class _Tag(str):
    """A stand-in for a tensor in diffusers' conversion, which only moves tensors between keys: its value is
    the kohya module it came from, so the converted key it lands under names that module's diffusers name."""


@dataclass(frozen=True)
class DiffusersKeys:
    """Keys of the adapters of a pipeline whose denoiser is node ("unet" or "transformer") with these module
    names, and which serves the text encoders named (none for a denoiser's own config)."""

    node: str
    names: frozenset[str]
    text_encoders: tuple[str, ...] = ()
    pipeline: str | None = None  # the diffusers pipeline whose lora_state_dict converts its trainers' layouts
    layers_per_block: int | None = None  # a UNet's, which places kohya's SGM block names (input_blocks_4_1_...)

    def __call__(self, keys: Sequence[str]) -> dict[str, tuple[str, str]]:
        kohya = {} if self.node != "unet" else _kohya_names(
            tuple(k for k in keys if k.startswith(("lora_unet_", *KOHYA_TEXT))), self.layers_per_block)
        traced = self._traced(tuple(keys))
        out = {}
        for key in keys:
            lora, _, _ = key.partition(".")
            source, role = split_key(key)
            if source in traced:
                out[key] = (traced[source], role)
                continue
            if lora in kohya:
                module, role = kohya[lora], split_key(key)[1]
                if text_encoder_of(module) is None and module not in self.names:
                    module = self._flat(lora)
            else:
                module, role = self._diffusers(key)
            component = module.partition(".")[0]
            if component in TEXT_ENCODERS and component not in self.text_encoders:
                role = "text_encoder"
            out[key] = (module, role)
        return out

    def _traced(self, keys: tuple[str, ...]) -> dict[str, str]:
        """Each source module (as split_key names it) the pipeline's own conversion places on modules of this
        model (or fuses over siblings of it)."""
        if self.pipeline is None:
            return {}
        modules = _traced(self.pipeline, keys, self.node)
        return {split_key(k)[0]: m for k, m in modules.items()
                if all(f"{m.rpartition('.')[0]}.{leaf}".lstrip(".") in self.names
                       for leaf in m.rpartition(".")[2].split("+"))}

    def _diffusers(self, key: str) -> tuple[str, str]:
        bare = key.removeprefix(PEFT_PREFIX)
        if bare.startswith(f"{self.node}."):
            return split_key(bare.removeprefix(f"{self.node}."))
        if bare.startswith(TEXT_ENCODERS):
            return split_key(bare)
        return trainer_key(bare, self._flat_names)

    def _flat(self, lora: str) -> str:
        """A kohya name diffusers' conversion mangles (lora_unet_add_embedding_linear_1), by the model's own
        module names; one they do not have keeps its key."""
        return self._flat_names.get(lora.removeprefix("lora_unet_"), lora)

    @functools.cached_property
    def _flat_names(self) -> dict[str, str]:
        return {n.replace(".", "_"): n for n in self.names}


@functools.lru_cache(maxsize=64)
def _traced(pipeline: str, keys: tuple[str, ...], node: str) -> dict[str, str]:
    import diffusers

    from .traced import traced_modules

    return traced_modules(getattr(diffusers, pipeline).lora_state_dict, keys, f"{node}.") or {}


@functools.lru_cache(maxsize=64)
def _kohya_names(keys: tuple[str, ...], layers_per_block: int | None = None) -> dict[str, str]:
    """Each kohya module name (lora_unet_..., lora_te1_...) of keys as diffusers' SDXL loader converts it:
    the UNet's without a prefix, a text encoder's under its component's name; SGM's block names (kohya's
    sd-scripts train SDXL on SGM's UNet: input_blocks_4_1_...) placed first by the UNet's layers_per_block,
    as the loader does with the UNet's config."""
    if not keys:
        return {}
    try:  # diffusers' own SDXL conversion, private to it: tested against diffusers 0.42
        from diffusers.loaders.lora_conversion_utils import (
            _convert_non_diffusers_lora_to_diffusers,
            _maybe_map_sgm_blocks_to_diffusers,
        )
        from diffusers.utils.state_dict_utils import (
            convert_state_dict_to_diffusers,
            convert_state_dict_to_peft,
            convert_unet_state_dict_to_peft,
        )
    except ImportError as e:
        raise ValueError(f"kohya's SDXL keys are read by diffusers' own conversion, which this diffusers lacks "
                         f"({e})") from None

    loras = sorted({k.partition(".")[0] for k in keys})
    stand_in = {f"{lora}.{role}.weight": _Tag(lora) for lora in loras for role in ("lora_down", "lora_up")}
    try:
        if layers_per_block is not None:
            stand_in = _maybe_map_sgm_blocks_to_diffusers(stand_in, SimpleNamespace(layers_per_block=layers_per_block))
        converted, _ = _convert_non_diffusers_lora_to_diffusers(stand_in)
    except Exception:  # diffusers' refusal of these names: they keep them, and no target maps them
        return {}
    out: dict[str, str] = {}
    unet = {k.removeprefix("unet."): v for k, v in converted.items() if k.startswith("unet.")}
    for key, lora in convert_unet_state_dict_to_peft(unet).items():
        module, _ = split_key(key)
        out[lora] = module
    for component in TEXT_ENCODERS:
        mine = {k.removeprefix(f"{component}."): v for k, v in converted.items() if k.startswith(f"{component}.")}
        if mine:
            for key, lora in convert_state_dict_to_peft(convert_state_dict_to_diffusers(mine)).items():
                out[lora] = f"{component}.{split_key(key)[0]}"
    return out


def text_encoder_of(module: str) -> str | None:
    """The text encoder a module name belongs to, or None."""
    component = module.partition(".")[0]
    return component if component in TEXT_ENCODERS else None

