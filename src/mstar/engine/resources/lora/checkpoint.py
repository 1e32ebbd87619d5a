"""An adapter on disk: where its files are, its checked header and config, its modules."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .adapter_config import AdapterConfig, read_config
from .safetensors_header import Header, TensorEntry, read_header

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"

ConvertKeys = Callable[[str], tuple[str, str]]


def where(name: str, path: str | os.PathLike[str]) -> str:
    return f"adapter {name!r} ({path})"


def refusal(name: str, path: str | os.PathLike[str], reasons: Iterable[str]) -> ValueError:
    """One ValueError naming the adapter and file, listing every reason."""
    reasons = list(reasons)
    if len(reasons) == 1:
        return ValueError(f"{where(name, path)}: {reasons[0]}")
    return ValueError(f"{where(name, path)}:\n" + "\n".join(f"  - {r}" for r in reasons))


def locate_files(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(weights, config) of a PEFT adapter directory or of its safetensors file."""
    p = Path(path)
    if p.is_dir():
        weights = p / WEIGHTS
        if not weights.is_file():
            if (p / "adapter_model.bin").exists():
                raise ValueError("only adapter_model.bin, a pickle this pool does not read: save it as safetensors")
            raise ValueError(f"no {WEIGHTS} in the directory")
    elif p.is_file():
        if p.suffix != ".safetensors":
            raise ValueError(f"{p.name} is not a safetensors file")
        weights = p
    else:
        raise ValueError("no such file or directory")
    config = weights.parent / CONFIG
    if not config.is_file():
        raise ValueError(f"no {CONFIG} beside {weights.name}, so its rank and alpha are unknown")
    return weights, config


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A PEFT adapter whose header and config have been read and checked, weights unread."""

    name: str
    weights: Path
    header: Header
    config: AdapterConfig

    def refusal(self, reasons: Iterable[str]) -> ValueError:
        return refusal(self.name, self.weights, reasons)

    def modules(self, convert_keys: ConvertKeys) -> dict[str, dict[str, TensorEntry]]:
        """module -> role -> tensor, as convert_keys reads the keys (computed once per conversion)."""
        if convert_keys not in self._modules:
            self._modules[convert_keys] = _group(self.header.tensors, convert_keys)
        return self._modules[convert_keys]

    @cached_property
    def _modules(self) -> dict[ConvertKeys, dict[str, dict[str, TensorEntry]]]:
        return {}

    @cached_property
    def size(self) -> int:
        return self.weights.stat().st_size


def _group(tensors: dict[str, TensorEntry], convert_keys: ConvertKeys) -> dict[str, dict[str, TensorEntry]]:
    out: dict[str, dict[str, TensorEntry]] = {}
    for key, entry in tensors.items():
        module, role = convert_keys(key)
        roles = out.setdefault(module, {})
        if role in roles:  # two keys read as the same weight: neither is trusted
            role = f"{role}:{key}"
        roles[role] = entry
    return out


def default_name(path: str | os.PathLike[str]) -> str:
    p = Path(path)
    return p.name if p.is_dir() or p.suffix != ".safetensors" else p.parent.name


def open_checkpoint(path: str | os.PathLike[str], name: str | None = None) -> Checkpoint:
    """The checkpoint at path with its header and config checked; ValueError naming adapter and file."""
    name = name or default_name(path)
    try:
        weights, config_path = locate_files(path)
    except ValueError as e:
        raise refusal(name, path, [str(e)]) from None
    try:
        header = read_header(weights)
    except (ValueError, OSError) as e:
        raise refusal(name, weights, [f"bad safetensors file: {e}"]) from None
    try:
        config = read_config(config_path)
    except (ValueError, OSError) as e:
        raise refusal(name, config_path, [str(e)]) from None
    return Checkpoint(name, weights, header, config)
