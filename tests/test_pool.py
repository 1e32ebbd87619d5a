"""The device pool: one copy per target, nothing copied twice, nothing leaking from one adapter to the next."""

from __future__ import annotations

import pytest
import torch
from tiny import make_adapter, model_config

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.pool import LoraDevicePool
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    spec = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
    store = LoraAdapterStore(spec, pin=False)
    made = {
        "all": make_adapter(root, name="all", seed=1)[1],
        "attn": make_adapter(root, name="attn", seed=2, target_modules=["q_proj", "v_proj", "o_proj"])[1],
        "mlp": make_adapter(root, name="mlp", seed=3, target_modules=["down_proj"], r=8)[1],
    }
    return spec, {n: store.read(n, p) for n, p in made.items()}


def test_activation_is_one_copy_per_target(adapters):
    spec, ads = adapters
    pool = LoraDevicePool(spec, slots=2)
    slot = pool.activate(ads["all"])
    assert (pool.copies, pool.fills) == (4, 0)
    assert pool.bytes_moved == ads["all"].nbytes, "a and b of each target lie back to back: no padding here"
    for t in spec.targets:
        assert torch.equal(pool.a[t][slot], ads["all"].a[t]) and torch.equal(pool.b[t][slot], ads["all"].b[t])
    assert pool.scaling[slot].item() == ads["all"].scaling


def test_reactivating_a_resident_adapter_copies_nothing(adapters):
    spec, ads = adapters
    pool = LoraDevicePool(spec, slots=2)
    first = pool.activate(ads["attn"])
    copies = pool.copies
    assert copies == 2, "attn touches qkv_proj and o_proj"
    assert pool.fills == 0, "a slot never written holds no weights to clear"
    assert pool.activate(ads["attn"]) == first and pool.copies == copies


def test_an_evicted_slots_missing_targets_are_zero(adapters):
    spec, ads = adapters
    pool = LoraDevicePool(spec, slots=1)
    pool.activate(ads["all"])
    slot = pool.activate(ads["mlp"])
    assert pool.resident() == ["mlp"] and (pool.copies, pool.fills) == (5, 3)
    for t in ("qkv_proj", "o_proj", "gate_up_proj"):
        assert pool.a[t][slot].abs().sum() == 0 and pool.b[t][slot].abs().sum() == 0, f"{t} leaked"
    assert torch.equal(pool.b["down_proj"][slot], ads["mlp"].b["down_proj"])


def test_slots_are_reused_least_recent_first_but_never_one_the_batch_needs(adapters):
    spec, ads = adapters
    pool = LoraDevicePool(spec, slots=2)
    pool.activate(ads["all"])
    pool.activate(ads["attn"])
    pool.activate(ads["all"])  # now attn is the least recent
    assert pool.activate(ads["mlp"], keep=["all"]) == pool.slot_of("mlp") and pool.slot_of("attn") is None
    with pytest.raises(RuntimeError, match="all 2 slots hold adapters the running batch needs"):
        pool.activate(ads["attn"], keep=["all", "mlp"])


def test_an_adapter_laid_out_for_another_pool_is_refused(adapters, tmp_path):
    _, ads = adapters
    other = specs_from_config(model_config("llama"), max_rank=16)["language_model"]
    with pytest.raises(ValueError, match=r"adapter .all.: target .* \(another max_rank"):
        LoraDevicePool(other, slots=1).activate(ads["all"])


def test_an_adapter_read_again_is_copied_again_unless_its_digest_says_it_is_the_same(tmp_path):
    spec = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
    store = LoraAdapterStore(spec, pin=False)
    pool = LoraDevicePool(spec, slots=2)
    _, path = make_adapter(tmp_path, name="ad", seed=1)
    digest = check_adapter_file(spec, "ad", path)
    pool.activate(store.read("ad", path, digest))
    assert pool.activate(store.read("ad", path, digest)) is not None and pool.copies == 4, "same digest: resident"
    pool.activate(store.read("ad", path))
    assert pool.copies == 8, "read without a digest: nothing says it is the same weights"
    make_adapter(tmp_path, name="ad", seed=2)  # rewritten in place, read again without a digest
    new = store.read("ad", path)
    slot = pool.activate(new)
    assert pool.copies == 12 and all(torch.equal(pool.a[t][slot], new.a[t]) for t in new.a)
