"""LoRA specs built from a Hugging Face config.json, one per node of the model, or derived from the model itself.

The builders import torch; the presets and load_config do not, so the command line's --help (which lists
the presets) starts at once: specs_from_config and the rest load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import PRESETS, load_config, model_type, presets

if TYPE_CHECKING:
    from .build import BUILDERS, specs_from_config
    from .derived import specs_from_model

__all__ = ["BUILDERS", "PRESETS", "load_config", "model_type", "presets", "specs_from_config", "specs_from_model"]
_BUILT = ("BUILDERS", "specs_from_config", "specs_from_model")


def __getattr__(name: str) -> Any:
    if name == "specs_from_model":  # the derivation imports torch and transformers
        from .derived import specs_from_model

        return specs_from_model
    if name in _BUILT:
        from . import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
