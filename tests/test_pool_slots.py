"""Which slot an activation takes: an empty one before any adapter's, so no adapter is evicted while a slot is
free, and the freed slot of a deactivated adapter before a resident one's; and what a slot refuses to take."""

from __future__ import annotations

import pytest
import torch
from tiny import make_adapter, model_config

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.pool import LoraDevicePool
from mstar.engine.resources.lora.store import LoraAdapterStore

SPEC = specs_from_config(model_config("llama"), max_rank=8)["language_model"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("slots")
    store = LoraAdapterStore(SPEC, pin=False)
    return {n: store.read(n, make_adapter(root, name=n, seed=i, target_modules=["q_proj"])[1])
            for i, n in enumerate("xyz")}


def test_a_fresh_pool_takes_its_empty_slots_before_evicting_anything(adapters):
    pool = LoraDevicePool(SPEC, slots=2)
    x, y = pool.activate(adapters["x"]), pool.activate(adapters["y"])
    assert x != y and sorted(pool.resident()) == ["x", "y"], "both fit: neither is evicted"
    assert pool.slot_of("x") == x and pool.slot_of("y") == y


def test_a_deactivated_adapters_slot_is_taken_before_a_resident_ones(adapters):
    pool = LoraDevicePool(SPEC, slots=2)
    x = pool.activate(adapters["x"])
    pool.activate(adapters["y"])
    pool.activate(adapters["y"])  # y the most recent, x free once deactivated
    pool.deactivate("x")
    assert pool.activate(adapters["z"]) == x and sorted(pool.resident()) == ["y", "z"]


def test_with_every_slot_resident_the_least_recently_activated_goes(adapters):
    pool = LoraDevicePool(SPEC, slots=2)
    x = pool.activate(adapters["x"])
    pool.activate(adapters["y"])
    pool.activate(adapters["x"])  # x again: y is the least recent now
    assert pool.activate(adapters["z"]) != x and sorted(pool.resident()) == ["x", "z"]


def test_an_adapter_read_in_another_dtype_is_refused_not_cast(tmp_path):
    """A float32 copy's block holds b where a float32 layout puts it, not where a bf16 slot does."""
    path = make_adapter(tmp_path, name="wide", target_modules=["q_proj"])[1]
    adapter = LoraAdapterStore(SPEC, pin=False, dtype=torch.float32).read("wide", path)
    pool = LoraDevicePool(SPEC, slots=1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^adapter 'wide': target qkv_proj is torch\.float32 \[3, 24, 64\] / "
                                         r"\[3, 128, 8\], this pool's slots are torch\.bfloat16 "):
        pool.activate(adapter)
    assert pool.resident() == [None] and pool.copies == 0
