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

from .acyclic import untrack
from .adapter_config import AdapterConfig, parse_config
from .checkpoint import CONFIG, Checkpoint, refusal
from .keys import PEFT_PREFIX
from .safetensors_header import DTYPES, Header, TensorEntry
from .source import unreadable_memory

WHERE = Path("<pushed tensors>")  # what refusals name in place of a file
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def tensor_checkpoint(name: str, tensors: Mapping[str, torch.Tensor], config: Any = None) -> Checkpoint:
    """tensors (a state dict in any layout the spec's key conversion reads) as a checkpoint. config
    gives rank and alpha as adapter_config.json would (its dict, or a peft LoraConfig); None where the
    tensors carry their alphas, or alpha is the rank."""
    problems, listing, resolved = [], [], {}
    if not isinstance(tensors, Mapping):
        raise refusal(name, WHERE, [f"its tensors are a {type(tensors).__name__}, not a state dict"])
    keys = [k for k in tensors if isinstance(k, str)]
    problems += [f"key {k!r} is a {type(k).__name__}, not a str" for k in tensors if not isinstance(k, str)]
    for key in sorted(keys):
        t = tensors[key]
        why = _unreadable(t)
        if why:
            problems.append(f"{key} {why}")
        else:
            # A negative view's memory holds the values' negations: read as bytes, it would serve -B.
            resolved[key] = t.resolve_neg() if t.is_neg() else t
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
    return Checkpoint(name, WHERE, _header(tuple(listing)), parsed, resolved)


def _unreadable(t: object) -> str | None:
    """Why a pushed value cannot be read as a tensor of a safetensors file, or None."""
    if not isinstance(t, torch.Tensor):
        return f"is a {type(t).__name__}, not a tensor"
    if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
        return "is uninitialized (a lazy module's, before its first forward)"
    if t.layout != torch.strided:
        return f"is a {t.layout} tensor; push dense ones (.to_dense())"
    if t.is_meta or t.device.type == "meta":
        return "is a meta tensor, which holds no values"
    if t.dtype not in _NAMES:
        return f"has dtype {t.dtype}, which no safetensors file holds"
    if t.is_conj():
        return "is a conjugate view"
    return unreadable_memory(t)


@functools.lru_cache(maxsize=64)  # pushes of one adapter's new weights share it, and what is derived from it
def _header(listing: tuple[tuple[str, str, tuple[int, ...]], ...]) -> Header:
    # Offsets as a buffer holding every tensor would have them, each aligned for any dtype: TensorSource
    # reads the tensors at them.
    entries, at = {}, 0
    for key, dtype, shape in listing:
        n = DTYPES[dtype].itemsize * math.prod(shape)
        entries[key] = TensorEntry(dtype, shape, at, at + n)
        at += max(-(-n // 16) * 16, 16)  # an empty tensor too has a start of its own
    untrack(entries.values())  # a str, sizes and ints: in no cycle (acyclic.py), as a file's entries
    return Header(entries, {}, 0, at, identity=listing)


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
