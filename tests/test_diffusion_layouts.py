"""The layouts diffusers reads for SD3, Flux 2, Qwen-Image, HunyuanVideo and LTX-Video, each file written by
diffusers' own save_lora_weights / convert_state_dict_to_kohya from a PEFT adapter: served with the delta the
pipeline's own LoRA loader gives after loading it, module by module. (~10 s.)"""

from __future__ import annotations

import pytest
import torch
from diffusion_models import MODELS, diffusers_loaded, model, peft_state, pipeline
from reference import lora_modules, peft_delta, slot_delta
from safetensors.torch import load_file, save_file

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


def bfl_file(path, modules, prefix="diffusion_model.", roles=("lora_A", "lora_B"), seed=3):
    """Random factors under the original (BFL / Tencent) module names diffusers' converters read, each
    module's (in, out) as the model has it."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (fan_in, fan_out) in modules.items():
        tensors[f"{prefix}{name}.{roles[0]}.weight"] = torch.randn(4, fan_in, generator=g)
        tensors[f"{prefix}{name}.{roles[1]}.weight"] = torch.randn(fan_out, 4, generator=g) * 0.1
    save_file(tensors, path)
    return path


FLUX2_BFL = {"double_blocks.0.img_attn.qkv": (16, 48), "double_blocks.0.txt_attn.qkv": (16, 48),
             "double_blocks.0.img_attn.proj": (16, 16), "double_blocks.0.txt_mlp.0": (16, 96),
             "double_blocks.0.img_mlp.2": (48, 16), "single_blocks.0.linear1": (16, 144),
             "single_blocks.0.linear2": (64, 16), "img_in": (8, 16), "double_stream_modulation_img.lin": (16, 96),
             "final_layer.linear": (16, 8)}


def test_flux2_ai_toolkit_layout_with_fused_qkv(tmp_path):
    """ai-toolkit's Flux 2 keys (BFL's names under diffusion_model., q, k, v fused), which diffusers' converter
    splits among to_q, to_k, to_v: served as the fused projection over them, with the delta diffusers gives."""
    file = bfl_file(tmp_path / "ait.safetensors", FLUX2_BFL)
    # each fused qkv loads as three modules
    assert_as_diffusers_loads(MODELS["flux2"], file, len(FLUX2_BFL) + 4)
    spec = specs_from_config(MODELS["flux2"], max_rank=4)["transformer"]
    modules = spec.convert_keys(list(load_file(file)))
    assert modules["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"] == (
        "transformer_blocks.0.attn.to_q+to_k+to_v", "A")


HUNYUAN_ORIGINAL = {"double_blocks.0.img_attn_qkv": (16, 48), "double_blocks.0.txt_attn_qkv": (16, 48),
                    "double_blocks.0.img_attn_proj": (16, 16), "double_blocks.0.txt_attn_proj": (16, 16),
                    "double_blocks.0.img_mlp.fc1": (16, 64), "double_blocks.0.txt_mlp.fc2": (64, 16),
                    "double_blocks.0.img_mod.linear": (16, 96), "single_blocks.0.linear2": (80, 16),
                    "single_blocks.0.modulation.linear": (16, 48), "time_in.mlp.0": (256, 16),
                    "final_layer.linear": (16, 4)}


def test_hunyuan_video_original_layout_with_fused_qkv(tmp_path):
    file = bfl_file(tmp_path / "hy.safetensors", HUNYUAN_ORIGINAL, prefix="")
    assert_as_diffusers_loads(MODELS["hunyuan_video"], file, len(HUNYUAN_ORIGINAL) + 4)


@pytest.mark.parametrize(("module", "shape"), [
    ("final_layer.adaLN_modulation.1", (16, 32)),  # diffusers swaps the halves of A's rank as of B's rows
    ("txt_in.individual_token_refiner.blocks.0.self_attn_qkv", (16, 48)),  # diffusers chunks its A's rank
])
def test_hunyuan_modules_diffusers_converts_wrongly_are_refused_by_name(tmp_path, module, shape):
    file = bfl_file(tmp_path / "hy.safetensors", {"double_blocks.0.img_attn_qkv": (16, 48), module: shape},
                    prefix="")
    spec = specs_from_config(MODELS["hunyuan_video"], max_rank=4)["transformer"]
    with pytest.raises(ValueError, match=rf"module {module.replace('.', '[.]')}: no target of transformer maps it"):
        check_adapter_file(spec, "hy", file)


def test_a_peft_dora_adapter_is_refused_naming_the_module(tmp_path):
    config = MODELS["sd3"]
    state = peft_state(model(config), use_dora=True, target_modules=["to_q"])
    pipeline(config).save_lora_weights(tmp_path, transformer_lora_layers=state)
    spec = specs_from_config(config, max_rank=4)["transformer"]
    with pytest.raises(ValueError, match=r"module transformer_blocks\.0\.attn\.to_q: a DoRA magnitude"):
        check_adapter_file(spec, "dora", tmp_path / "pytorch_lora_weights.safetensors")


def test_a_config_diffusers_refuses_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"model config: diffusers cannot build SD3Transformer2DModel from it"):
        specs_from_config({**MODELS["sd3"], "num_attention_heads": "two"}, max_rank=4)


def test_trainers_keys_go_where_diffusers_own_conversion_puts_them():
    """Qwen-Image's kohya keys traced through QwenImagePipeline.lora_state_dict, every factor placed; a
    conversion that reads values (Flux 2's kohya one bakes alpha / rank into the factors) places none of
    the modules it reads, so they keep their names and are refused by them."""
    import diffusers
    from diffusers.utils import convert_state_dict_to_kohya

    from mstar.engine.resources.lora.models.traced import traced_modules

    state = peft_state(model(MODELS["qwen_image"]))
    keys = [k for k in convert_state_dict_to_kohya({f"unet.{k}": v for k, v in state.items()}) if "alpha" not in k]
    placed = traced_modules(diffusers.QwenImagePipeline.lora_state_dict, keys, "transformer.")
    assert placed["lora_unet_transformer_blocks_1_attn_to_add_out.lora_up.weight"] == \
        "transformer_blocks.1.attn.to_add_out"
    assert len(placed) == len(keys)
    flux2 = ["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
             "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"]
    assert not traced_modules(diffusers.Flux2Pipeline.lora_state_dict, flux2, "transformer.")
