"""Each module's real rank, from the read to the device slot: what the kernels compute instead of max_rank."""

from __future__ import annotations

import pytest
import torch
from moe import CONFIGS, stacked_adapter
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import LoadedAdapter, LoraAdapterStore, LoraDevicePool, specs_from_config


def read(tmp_path, arch="llama", name="ad", max_rank=8, **lora):
    config = model_config(arch)
    spec = specs_from_config(config, max_rank=max_rank)["language_model"]
    _, path = make_adapter(tmp_path, arch, name=name, config=config, **lora)
    return spec, LoraAdapterStore(spec, pin=False).read(name, path)


def test_ranks_follow_rank_pattern_per_layer_and_slice_and_are_zero_where_nothing_is(tmp_path):
    _, ad = read(tmp_path, r=4, rank_pattern={"k_proj": 2, "layers.2.mlp.up_proj": 7},
                 target_modules=["q_proj", "k_proj", "up_proj"], layers_to_transform=[0, 2])
    assert set(ad.ranks) == {"qkv_proj", "gate_up_proj"}, "a target the adapter lacks has no ranks"
    assert ad.ranks["qkv_proj"].tolist() == [[4, 2, 0], [0, 0, 0], [4, 2, 0]]
    assert ad.ranks["gate_up_proj"].tolist() == [[0, 4], [0, 0], [0, 7]]
    assert ad.rank == 7


def test_a_module_fused_in_the_base_model_gives_every_slice_its_rank(tmp_path):
    _, ad = read(tmp_path, "phi3", r=3)
    assert ad.ranks["qkv_proj"].tolist() == [[3, 3, 3]] * 3 and ad.ranks["gate_up_proj"].tolist() == [[3, 3]] * 3


def test_stacked_experts_give_every_expert_slice_its_rank(tmp_path):
    _, path = stacked_adapter(tmp_path, "qwen3_moe", rank_pattern={"gate_up_proj": 4})
    spec = specs_from_config(CONFIGS["qwen3_moe"], max_rank=8, max_expert_rank=4)["experts"]
    ad = LoraAdapterStore(spec, pin=False).read("ad", path)
    assert (ad.ranks["experts_gate_up"] == 4).all() and (ad.ranks["experts_down"] == 2).all()
    assert ad.rank == 4, "the adapter's rank is its largest module's (gate_up_proj's 4), not down_proj's 2"


def test_a_slot_takes_its_adapters_ranks_and_loses_them_to_the_next(tmp_path):
    spec, full = read(tmp_path, name="full", r=4, rank_pattern={"v_proj": 1})
    _, mlp = read(tmp_path, name="mlp", r=6, target_modules=["down_proj"])
    pool = LoraDevicePool(spec, 1)
    pool.activate(full)
    assert pool.ranks["qkv_proj"][0].tolist() == [[4, 4, 1]] * 3 and pool.ranks["down_proj"][0].tolist() == [[4]] * 3
    pool.activate(mlp)
    assert (pool.ranks["qkv_proj"][0] == 0).all(), "no rank of the last adapter is left to read its zeroed weights"
    assert pool.ranks["down_proj"][0].tolist() == [[6]] * 3


def test_an_adapter_built_by_hand_is_taken_at_max_rank_and_bad_ranks_are_refused(tmp_path):
    spec, ad = read(tmp_path, r=2, target_modules=["o_proj"])
    pool = LoraDevicePool(spec, 2)
    by_hand = LoadedAdapter("hand", None, 2, 1.0, dict(ad.a), dict(ad.b))
    slot = pool.activate(by_hand)
    assert (pool.ranks["o_proj"][slot] == 8).all() and (pool.ranks["qkv_proj"][slot] == 0).all()
    bad = LoadedAdapter("bad", None, 2, 1.0, dict(ad.a), dict(ad.b), ranks={"o_proj": torch.full((3, 1), 9)})
    with pytest.raises(ValueError, match=r"adapter 'bad': target o_proj's ranks are \[3, 1\] from 9 to 9, this "
                                         r"pool's are \[3, 1\] from 0 to max_rank 8"):
        pool.activate(bad)
