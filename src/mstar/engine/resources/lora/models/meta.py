"""A transformers model built on the meta device from its config: its tree and plan at no memory cost, for
an architecture no builder here knows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

# The auto classes tried, in order, for a config that names no architecture: a vision-language model's
# class before the causal LM some of them also have (Mllama's, which drops the vision tower).
AUTO_CLASSES = ("AutoModelForImageTextToText", "AutoModelForCausalLM", "AutoModel")


def meta_model(raw: Mapping[str, Any], source: str) -> nn.Module:
    """The model raw (a config.json's dict) describes, its weights on the meta device; ValueError where
    transformers is not installed, does not know the model_type or cannot build it."""
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{source}: no builder here knows its architecture, and transformers, which would derive "
                         "one from the model, is not installed") from None
    kind = raw.get("model_type")
    if not isinstance(kind, str) or kind not in transformers.CONFIG_MAPPING:
        raise ValueError(f"{source}: unknown architecture {kind!r}: neither a builder here nor transformers "
                         f"{transformers.__version__} knows it")
    try:
        config = transformers.AutoConfig.for_model(**dict(raw))
    except Exception as e:  # transformers' own validation, whatever it raises
        raise ValueError(f"{source}: transformers refuses the {kind} config: {e}") from None
    errors = []
    for cls in _classes(transformers, raw):
        try:
            with torch.device("meta"):
                return (cls.from_config if hasattr(cls, "from_config") else cls._from_config)(config)
        except Exception as e:  # an auto class that does not map this config, or a config it cannot build
            errors.append(f"{getattr(cls, '__name__', cls)}: {str(e)[:200]}")
    raise ValueError(f"{source}: transformers cannot build the {kind} model ({'; '.join(errors)})")


def _classes(transformers: Any, raw: Mapping[str, Any]) -> list[Any]:
    named = raw.get("architectures")
    named = [a for a in named if isinstance(a, str)] if isinstance(named, list) else []
    found = [getattr(transformers, a) for a in named if isinstance(getattr(transformers, a, None), type)]
    return [c for c in found if hasattr(c, "_from_config")] + [getattr(transformers, a) for a in AUTO_CLASSES]
