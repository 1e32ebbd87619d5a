"""SDXL's UNet, SD3, Flux 2, Qwen-Image, HunyuanVideo and LTX-Video, served from their diffusers config through
the derived spec: PEFT's own adapter on every linear (and on the UNet's convs) gives the delta PEFT computes on
the real diffusers module, at world size 1 and 2, the ranks' shards put back together. (~15 s on 2 cores.)"""

from __future__ import annotations

import pytest
from derived import all_linear_adapter, assert_serves_peft
from diffusion_models import MODELS, SDXL_UNET, UNET_CONVS, model

from mstar.engine.resources.lora.models import specs_from_config


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_peft_all_linear_adapter_is_served_exactly(tmp_path, name, world_size):
    config = MODELS[name]
    pm, path = all_linear_adapter(tmp_path, model(config))
    specs = specs_from_config(config, max_rank=4)
    assert list(specs) == ["unet" if name == "sdxl" else "transformer"]
    checked = assert_serves_peft(pm, specs, path, world_size)
    assert len(checked) == sum(1 for _ in _linears(pm)), "every linear PEFT adapted is served"


def _linears(pm):
    from peft.tuners.lora import LoraLayer

    return [m for m in pm.modules() if isinstance(m, LoraLayer)]


@pytest.mark.parametrize("world_size", [1, 2])
def test_unet_conv_adapter_is_served_as_linears_over_the_patch(tmp_path, world_size):
    pm, path = all_linear_adapter(tmp_path, model(SDXL_UNET), target_modules=UNET_CONVS)
    specs = specs_from_config(SDXL_UNET, max_rank=4)
    checked = assert_serves_peft(pm, specs, path, world_size)
    assert {"conv_in", "conv_out", "down_blocks.0.resnets.0.conv1", "up_blocks.0.resnets.0.conv_shortcut",
            "down_blocks.0.downsamplers.0.conv"} <= checked
    assert specs["unet"].targets[specs["unet"].locate("conv_in").target].kernel == (3, 3)


def test_attention_and_feed_forward_shard_by_rule():
    spec = specs_from_config(MODELS["flux2"], max_rank=4)["transformer"]
    by_module = {m: spec.targets[spec.locate(m).target] for m in (
        "transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.ff.linear_in",
        "transformer_blocks.0.ff.linear_out", "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
        "single_transformer_blocks.0.attn.to_out", "double_stream_modulation_img.linear")}
    qkv, out, up, down, packed, single_out, mod = by_module.values()
    assert (qkv.parallel, qkv.out_features, qkv.heads) == ("column", (16, 16, 16), (2, 2, 2))
    assert out.parallel == down.parallel == "row"
    assert (up.parallel, up.out_features) == ("column", (48, 48)), "a gated feed-forward's gate and up, apart"
    assert (packed.out_features, packed.heads) == ((16, 16, 16, 48, 48), (2, 2, 2, None, None))
    assert single_out.parallel == mod.parallel == "replicated", "reads attention and MLP outputs concatenated"


def test_a_cross_attentions_q_is_not_fused_with_its_k_and_v():
    spec = specs_from_config(MODELS["ltx_video"], max_rank=4)["transformer"]
    assert spec.locate("transformer_blocks.0.attn1.to_k").target == "transformer_blocks.*.attn1.to_q+to_k+to_v"
    assert spec.locate("transformer_blocks.0.attn2.to_q").target == "transformer_blocks.*.attn2.to_q"
    assert spec.locate("transformer_blocks.0.attn2.to_v")[1:] == (0, 1)


def test_an_unknown_diffusers_class_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown architecture 'NoSuchTransformer': neither a builder here nor "
                                         r"diffusers"):
        specs_from_config({"_class_name": "NoSuchTransformer"}, max_rank=4)
