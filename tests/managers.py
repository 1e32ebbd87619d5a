"""The one-node manager the manager tests drive: the tiny Llama's language model, float32, on the CPU."""

from __future__ import annotations

import torch
from tiny import model_config

from mstar.engine.resources.lora import LoraAdapterStore, LoraDevicePool, specs_from_config
from mstar.engine.resources.lora.manager import LoraManager


def one_node(capacity: int = 4, slots: int = 2, store_class: type[LoraAdapterStore] = LoraAdapterStore,
             max_bytes: int | None = None) -> LoraManager:
    spec = specs_from_config(model_config("llama"), max_rank=8, capacity=capacity, dtype=torch.float32)
    spec = spec["language_model"]
    return LoraManager({"language_model": store_class(spec, pin=False, max_bytes=max_bytes)},
                       {"language_model": LoraDevicePool(spec, slots, dtype=torch.float32)})


def settle(m: LoraManager, running, waiting):
    """A step, then the reads it started landed, then the step again."""
    m.step(running, waiting)
    m.wait_for_reads()
    return m.step(running, waiting)
