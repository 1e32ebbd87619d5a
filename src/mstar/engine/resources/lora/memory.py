"""Adapters pushed from memory: a state dict read as a checkpoint, as if it had been saved to a file.

A reinforcement-learning loop pushes new LoRA weights every training step. Its tensors get a header
that lists them as safetensors would (same dtypes, shapes, and sizes), so they go through the same
checks, the same digest (equal to the digest of the same weights saved as a file), the same sharding
and the same layout as a file. They are read, never written: scalings fold into the host copy's B,
not into the caller's, so a copy rebuilt after an eviction is the first one again.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .adapter_config import AdapterConfig, parse_config
from .checkpoint import CONFIG, Checkpoint, refusal
from .keys import PEFT_PREFIX
from .safetensors_header import DTYPES, Header, TensorEntry

WHERE = Path("<pushed tensors>")  # what refusals name in place of a file
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def tensor_checkpoint(name: str, tensors: Mapping[str, torch.Tensor], config: Any = None) -> Checkpoint:
    """tensors (a state dict in any layout the spec's key conversion reads) as a checkpoint. config
    gives rank and alpha as adapter_config.json would (its dict, or a peft LoraConfig); None where the
    tensors carry their alphas, or alpha is the rank."""
    problems, listing = [], []
    for key in sorted(tensors):
        t = tensors[key]
        if not isinstance(t, torch.Tensor):
            problems.append(f"{key} is a {type(t).__name__}, not a tensor")
        elif t.dtype not in _NAMES:
            problems.append(f"{key} has dtype {t.dtype}, which no safetensors file holds")
        else:
            listing.append((key, _NAMES[t.dtype], tuple(t.shape)))
    if not listing and not problems:
        problems.append("it holds no tensors")
    try:
        parsed = _config(config)
    except ValueError as e:
        problems.append(str(e))
        parsed = None
    if config is None and any(k.startswith(PEFT_PREFIX) for k in tensors):
        problems.append(f"PEFT's keys with no config (the fields of {CONFIG}), so its rank and alpha are unknown")
    if problems:
        raise refusal(name, WHERE, problems)
    return Checkpoint(name, WHERE, _header(tuple(listing)), parsed, dict(tensors))


@functools.lru_cache(maxsize=64)  # pushes of one adapter's new weights share it, and what is derived from it
def _header(listing: tuple[tuple[str, str, tuple[int, ...]], ...]) -> Header:
    entries, at = {}, 0
    for key, dtype, shape in listing:
        n = DTYPES[dtype].itemsize * math.prod(shape)
        entries[key] = TensorEntry(dtype, shape, at, at + n)
        at += n
    return Header(entries, {}, 0, at)


def _config(config: Any) -> AdapterConfig | None:
    if config is None or isinstance(config, AdapterConfig):
        return config
    raw = config.to_dict() if hasattr(config, "to_dict") else config
    if not isinstance(raw, Mapping):
        raise ValueError(f"its config is a {type(config).__name__}, not adapter_config.json's fields")
    return parse_config({k: _plain(v) for k, v in raw.items()}, source="its config")


def _plain(value: Any) -> Any:
    """A LoraConfig field as JSON would hold it: its enums (peft_type) as their values, its sets as lists."""
    if isinstance(value, enum.Enum):
        return value.value
    return sorted(value) if isinstance(value, (set, frozenset)) else value
