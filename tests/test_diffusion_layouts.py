"""The layouts diffusers reads for SD3, Flux 2, Qwen-Image, HunyuanVideo and LTX-Video, each file written by
diffusers' own save_lora_weights / convert_state_dict_to_kohya from a PEFT adapter: served with the delta the
pipeline's own LoRA loader gives after loading it, module by module. (~10 s.)"""

from __future__ import annotations

import pytest
import torch
from diffusion_models import MODELS, diffusers_loaded, model, peft_state, pipeline
from reference import lora_modules, peft_delta, slot_delta
from safetensors.torch import save_file

from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file, specs_from_config

TRANSFORMERS = ["sd3", "flux2", "qwen_image", "hunyuan_video", "ltx_video"]


def assert_as_diffusers_loads(config, file, count):
    spec = specs_from_config(config, max_rank=4)["transformer"]
    adapter = LoraAdapterStore(spec, pin=False, dtype=torch.float32).read("ad", file, check_adapter_file(spec, "ad",
                                                                                                         file))
    loaded = lora_modules(diffusers_loaded(config, file))
    assert len(loaded) == count, "diffusers loaded every module"
    g = torch.Generator().manual_seed(0)
    for module, layer in loaded.items():
        x = torch.randn(3, layer.base_layer.in_features, generator=g)
        got = slot_delta(adapter.a, adapter.b, adapter.scaling, spec, module, x)
        torch.testing.assert_close(got, peft_delta(layer, x), rtol=1e-4, atol=1e-6, msg=module)


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_save_lora_weights_layout_with_its_metadata(tmp_path, name):
    config = MODELS[name]
    state = peft_state(model(config), lora_alpha=8, rank_pattern={"proj_out": 2})
    from peft import LoraConfig

    metadata = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", rank_pattern={"proj_out": 2}).to_dict()
    pipeline(config).save_lora_weights(tmp_path, transformer_lora_layers=state,
                                       transformer_lora_adapter_metadata=metadata)
    assert_as_diffusers_loads(config, tmp_path / "pytorch_lora_weights.safetensors", len(state) // 2)


def test_qwen_image_kohya_layout_with_alphas(tmp_path):
    """musubi-tuner's and kohya's Qwen-Image keys (lora_unet_transformer_blocks_0_attn_to_q, .alpha), as
    convert_state_dict_to_kohya writes a denoiser's ("unet") adapter."""
    from diffusers.utils import convert_state_dict_to_kohya

    state = peft_state(model(MODELS["qwen_image"]))
    kohya = convert_state_dict_to_kohya({f"unet.{k}": v for k, v in state.items()})
    assert any(k.startswith("lora_unet_transformer_blocks_0_attn_to_add_out") for k in kohya)
    save_file({k: v.contiguous() for k, v in kohya.items()}, tmp_path / "kohya.safetensors")
    assert_as_diffusers_loads(MODELS["qwen_image"], tmp_path / "kohya.safetensors", len(state) // 2)


@pytest.mark.parametrize("name", ["ltx_video", "qwen_image"])
def test_diffusion_model_prefix_layout(tmp_path, name):
    """LTX-Video's trainers' and ComfyUI's keys: PEFT's under diffusion_model. (no alpha: alpha is the rank)."""
    state = peft_state(model(MODELS[name]))
    save_file({f"diffusion_model.{k}": v.contiguous() for k, v in state.items()}, tmp_path / "d.safetensors")
    assert_as_diffusers_loads(MODELS[name], tmp_path / "d.safetensors", len(state) // 2)
