"""A model config's fields, read with their types and ranges checked.

A config is untrusted input like an adapter: `num_attention_heads: 0`, `hidden_size: "128"` or
`num_hidden_layers: null` must be a ValueError naming the config and the field, not a ZeroDivisionError
or TypeError deep in a builder. The builders read a config as a plain mapping; `CheckedConfig` is that
mapping with each field checked, by its name, as it is read, so the rule for a field is written once here
and no builder can read one unchecked (tests/test_model_configs.py holds every builder to that).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

MAX_SIZE = 2**31 - 1  # past any real width or count, and far from overflowing a tensor's size
Check = Callable[[Any], str | None]  # why a value does not do for its field, or None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _size(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        return "not a positive integer"
    return f"over {MAX_SIZE}" if v > MAX_SIZE else None


def _nullable(check: Check) -> Check:
    """check, with null allowed: the builders read these fields as `config.get(name) or default`."""
    return lambda v: None if v is None else check(v)


def _number(v: Any) -> str | None:
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0
    return None if ok else "not a positive number"


def _flag(v: Any) -> str | None:
    return None if isinstance(v, bool) or v is None else "not true or false"


def _text(v: Any) -> str | None:
    return None if isinstance(v, str) or v is None else "not a string"


def _texts(v: Any) -> str | None:
    ok = v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v))
    return None if ok else "not a list of strings"


def _layer_indices(v: Any) -> str | None:
    ok = v is None or (isinstance(v, list) and all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_SIZE for x in v))
    return None if ok else "not a list of layer indices"


def _sizes(count: int) -> Check:
    def check(v: Any) -> str | None:
        if v is None:
            return None
        if not isinstance(v, list) or len(v) != count or any(_size(x) for x in v):
            return f"not a list of {count} positive integers"
        return None

    return check


def _config(v: Any) -> str | None:
    return None if isinstance(v, Mapping) or v is None else "not a JSON object"


SIZE, OPTIONAL_SIZE = _size, _nullable(_size)

# Every field a builder in models/ reads, and what it must be.
FIELDS: dict[str, Check] = {
    # what the architecture is
    "model_type": _text, "_class_name": _text, "architectures": _texts,
    "text_config": _config, "vision_config": _config,
    # decoders (and a vision-language model's text_config)
    "hidden_size": SIZE, "num_hidden_layers": SIZE, "num_attention_heads": SIZE, "intermediate_size": SIZE,
    "num_key_value_heads": OPTIONAL_SIZE, "head_dim": OPTIONAL_SIZE,
    # mixtures of experts
    "num_experts": SIZE, "num_local_experts": SIZE, "moe_intermediate_size": SIZE,
    "decoder_sparse_step": SIZE, "mlp_only_layers": _layer_indices,
    # vision towers
    "depth": SIZE, "embed_dim": SIZE, "num_heads": SIZE, "patch_size": SIZE, "temporal_patch_size": SIZE,
    "in_channels": SIZE, "in_chans": SIZE, "mlp_ratio": _number, "spatial_merge_size": SIZE, "out_hidden_size": SIZE,
    # diffusion transformers
    "attention_head_dim": SIZE, "num_layers": SIZE, "num_single_layers": SIZE, "ffn_dim": SIZE,
    "freq_dim": SIZE, "text_dim": SIZE, "joint_attention_dim": SIZE, "pooled_projection_dim": SIZE,
    "out_channels": OPTIONAL_SIZE, "image_dim": OPTIONAL_SIZE, "added_kv_proj_dim": OPTIONAL_SIZE,
    "guidance_embeds": _flag,
}
# Where a family reads a field its own way.
FAMILY_FIELDS: dict[str, dict[str, Check]] = {
    "wan": {"patch_size": _sizes(3)},  # a Conv3d's (t, h, w); null for the default (1, 2, 2)
}


class FieldError(ValueError):
    """A config field that is not what the builders read it as; its message names the config and the field."""


class CheckedConfig(Mapping[str, Any]):
    """A model config whose fields are checked as they are read; a nested config (text_config,
    vision_config) comes back checked too, its fields named by their path."""

    def __init__(self, raw: Mapping[str, Any], source: str, family: str | None = None, prefix: str = ""):
        self._raw, self._source, self._family, self._prefix = raw, source, family, prefix
        self._checks = {**FIELDS, **FAMILY_FIELDS.get(family or "", {})}

    def __getitem__(self, key: str) -> Any:
        try:
            value = self._raw[key]
        except KeyError:
            raise KeyError(self._prefix + key) from None  # the builder's missing field, named by its path
        check = self._checks.get(key)
        why = check(value) if check is not None else None
        if why:
            raise FieldError(f"{self._source}: {self._prefix}{key} is {_shown(value)}, {why}")
        if isinstance(value, Mapping):
            return CheckedConfig(value, self._source, self._family, f"{self._prefix}{key}.")
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)
