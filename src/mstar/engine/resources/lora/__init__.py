"""mstar.engine.resources.lora: the adapter pool of a multi-LoRA inference engine."""

from .spec import AdapterInfo, LoraSpec, LoraTarget

__all__ = ["AdapterInfo", "LoraSpec", "LoraTarget"]
