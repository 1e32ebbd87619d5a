"""mstar.engine.resources.lora: the adapter pool of a multi-LoRA inference engine.

The engine-facing names are importable from here: the model's specs, the startup check, the host
tier (store), the device tier (pool), the LoRA op and its per-step batch, and the manager that runs them
per step.
Each loads on first use, so what needs no torch (the command line's --help) starts without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .apply import add_lora
    from .batch import LoraBatch
    from .check import adapter_targets, check_adapter_file, check_adapters, inspect_adapter
    from .digest import adapter_digest
    from .layout import SlotLayout, TargetLayout
    from .manager import Counters, LoraManager, Request, Step
    from .models import specs_from_config, specs_from_model
    from .pool import LoraDevicePool
    from .registry import Version
    from .spec import AdapterInfo, Location, LoraSpec, LoraTarget
    from .store import LoadedAdapter, LoraAdapterStore

# Each name, and the module it lives in.
_HOMES = {
    "add_lora": "apply",
    "LoraBatch": "batch",
    "adapter_targets": "check", "check_adapter_file": "check", "check_adapters": "check", "inspect_adapter": "check",
    "adapter_digest": "digest",
    "SlotLayout": "layout", "TargetLayout": "layout",
    "Counters": "manager", "LoraManager": "manager", "Request": "manager", "Step": "manager",
    "specs_from_config": "models", "specs_from_model": "models",
    "LoraDevicePool": "pool",
    "Version": "registry",
    "AdapterInfo": "spec", "Location": "spec", "LoraSpec": "spec", "LoraTarget": "spec",
    "LoadedAdapter": "store", "LoraAdapterStore": "store",
}

__all__ = [
    "AdapterInfo",
    "Counters",
    "LoadedAdapter",
    "Location",
    "LoraAdapterStore",
    "LoraBatch",
    "LoraDevicePool",
    "LoraManager",
    "LoraSpec",
    "LoraTarget",
    "Request",
    "SlotLayout",
    "Step",
    "TargetLayout",
    "Version",
    "adapter_digest",
    "adapter_targets",
    "add_lora",
    "check_adapter_file",
    "check_adapters",
    "inspect_adapter",
    "specs_from_config",
    "specs_from_model",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
