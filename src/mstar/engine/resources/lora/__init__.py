"""mstar.engine.resources.lora: the adapter pool of a multi-LoRA inference engine.

The engine-facing names are importable from here: the model's specs, the startup check, the host
tier (store), the device tier (pool), the reference op, and the manager that runs them per step.
"""

from .apply import add_lora
from .check import adapter_targets, check_adapter_file, check_adapters, inspect_adapter
from .digest import adapter_digest
from .layout import SlotLayout, TargetLayout
from .manager import Counters, LoraManager, Request, Step
from .models import specs_from_config
from .pool import LoraDevicePool
from .registry import Version
from .spec import AdapterInfo, Location, LoraSpec, LoraTarget
from .store import LoadedAdapter, LoraAdapterStore

__all__ = [
    "AdapterInfo",
    "Counters",
    "LoadedAdapter",
    "Location",
    "LoraAdapterStore",
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
]
