"""Stacked experts whose scaling differs by layer: each layer's own scaling is folded into its experts' B, as
PEFT's delta has it, in a float32 store exactly and in a bf16 store folded in float32 and cast once."""

from __future__ import annotations

import pytest
import torch
from moe import assert_deltas, peft_expert_deltas, read, stacked_adapter

from mstar.engine.resources.lora import LoraAdapterStore

# Layer 1's experts' down_proj at an alpha of its own: the experts_down target then holds two scalings, so its
# B is folded expert by expert as it is copied (not once for the whole target).
ALPHAS = {"layers.1.mlp.experts.down_proj": 6}


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_layer_of_stacked_experts_at_its_own_scaling_gives_peft_delta(tmp_path, family):
    pm, path = stacked_adapter(tmp_path, family, alpha_pattern=ALPHAS)
    spec, exact = read(family, path)
    for layer in range(2):
        assert_deltas(exact, spec, *peft_expert_deltas(pm, family, layer), layer, f"{family} layer {layer}")
    _, cast = read(family, path, store=LoraAdapterStore(spec, pin=False, dtype=torch.bfloat16))
    assert cast.scaling == exact.scaling
    for t in exact.a:
        assert torch.equal(cast.a[t], exact.a[t].to(torch.bfloat16)), t
        assert torch.equal(cast.b[t], exact.b[t].to(torch.bfloat16)), f"{t}: folded in float32, then cast"


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_layers_to_transform_leaves_stacked_experts_in_every_layer_as_peft_does(tmp_path, family):
    """PEFT injects target_parameters without looking at layers_to_transform: it saves every layer's experts,
    and they are served, each layer at PEFT's delta."""
    pm, path = stacked_adapter(tmp_path, family, layers_to_transform=[0])
    spec, adapter = read(family, path)
    for layer in range(2):
        assert_deltas(adapter, spec, *peft_expert_deltas(pm, family, layer), layer, f"{family} layer {layer}")
