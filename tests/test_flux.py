"""FLUX LoRAs (diffusers, BFL and kohya layouts) give the delta diffusers applies after loading them."""

from __future__ import annotations

import pytest
import torch
from diffusion import FLUX, loaded, save_flux_lora
from reference import lora_modules, module_input, peft_delta, slot_delta
from safetensors.torch import save_file

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file

DIM, MLP = 16, 64


def spec():
    return specs_from_config(FLUX, max_rank=8)["transformer"]


def read(file):
    s = spec()
    return LoraAdapterStore(s, pin=False, dtype=torch.float32).read("flux", file, check_adapter_file(s, "flux", file))


def assert_matches(adapter, transformer, expect=None):
    s = spec()
    loaded = lora_modules(transformer)
    g = torch.Generator().manual_seed(0)
    for module, layer in loaded.items():
        x = module_input(layer, 3, g)
        got = slot_delta(adapter.a, adapter.b, adapter.scaling, s, module, x)
        torch.testing.assert_close(got, peft_delta(layer, x), rtol=1e-5, atol=1e-6, msg=module)
    if expect is not None:
        assert set(loaded) == expect


def test_diffusers_layout_every_target(tmp_path):
    file = save_flux_lora(tmp_path / "d", rank_pattern={"proj_mlp": 2}, alpha_pattern={"to_add_out": 2})
    adapter = read(file)
    assert set(adapter.a) == set(spec().targets), "every linear trainers put LoRA on is a target"
    assert_matches(adapter, loaded(FLUX, file))


def kohya_file(path, prefix, down, up, alpha):
    """Random fused FLUX factors in kohya's (or BFL's) layout, alpha differing per module."""
    g = torch.Generator().manual_seed(3)
    shapes = {  # module -> (in, out)
        "double_blocks_0_img_attn_qkv": (DIM, 3 * DIM), "double_blocks_0_txt_attn_qkv": (DIM, 3 * DIM),
        "double_blocks_0_img_attn_proj": (DIM, DIM), "double_blocks_0_img_mlp_0": (DIM, MLP),
        "double_blocks_0_txt_mlp_2": (MLP, DIM), "double_blocks_0_img_mod_lin": (DIM, 6 * DIM),
        "single_blocks_0_linear2": (DIM + MLP, DIM), "single_blocks_0_modulation_lin": (DIM, 3 * DIM),
    }
    tensors = {}
    for i, (module, (fan_in, fan_out)) in enumerate(shapes.items()):
        name = prefix + (module if prefix == "lora_unet_" else bfl(module))
        tensors[f"{name}.{down}"] = torch.randn(4, fan_in, generator=g)
        tensors[f"{name}.{up}"] = torch.randn(fan_out, 4, generator=g) * 0.1
        if alpha:
            tensors[f"{name}.alpha"] = torch.tensor(2.0 + i)
    save_file(tensors, path)
    return path


def bfl(flat: str) -> str:
    from mstar.engine.resources.lora.models.flux import flat_names

    return flat_names(FLUX["num_layers"], FLUX["num_single_layers"])[flat]


def test_kohya_layout_with_fused_qkv_and_alphas(tmp_path):
    file = kohya_file(tmp_path / "kohya.safetensors", "lora_unet_", "lora_down.weight", "lora_up.weight", True)
    adapter = read(file)
    double = [f"transformer_blocks.0.{m}" for m in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj",
                                                     "attn.add_k_proj", "attn.add_v_proj", "attn.to_out.0",
                                                     "ff.net.0.proj", "ff_context.net.2", "norm1.linear")]
    single = ["single_transformer_blocks.0.proj_out", "single_transformer_blocks.0.norm.linear"]
    assert_matches(adapter, loaded(FLUX, file), expect={*double, *single})


def test_bfl_layout_reads_as_kohya(tmp_path):
    k = read(kohya_file(tmp_path / "k.safetensors", "lora_unet_", "lora_down.weight", "lora_up.weight", True))
    b = read(kohya_file(tmp_path / "b.safetensors", "diffusion_model.", "lora_A.weight", "lora_B.weight", True))
    assert k.digest == b.digest and k.scaling == b.scaling
    assert all(torch.equal(k.a[t], b.a[t]) and torch.equal(k.b[t], b.b[t]) for t in k.a)


def test_single_block_linear1_is_q_k_v_and_the_mlp_sharing_one_a(tmp_path):
    """diffusers' own kohya loader hard-codes FLUX.1's widths, so linear1 is checked against the same
    weights in diffusers' layout: q, k, v and proj_mlp each with linear1's A and its rows of B."""
    g = torch.Generator().manual_seed(5)
    a, b, alpha = torch.randn(4, DIM, generator=g), torch.randn(3 * DIM + MLP, 4, generator=g) * 0.1, 6.0
    kohya = tmp_path / "linear1.safetensors"
    save_file({"lora_unet_single_blocks_0_linear1.lora_down.weight": a,
               "lora_unet_single_blocks_0_linear1.lora_up.weight": b,
               "lora_unet_single_blocks_0_linear1.alpha": torch.tensor(alpha)}, kohya)
    split = dict(zip(["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"], b.split([DIM, DIM, DIM, MLP]), strict=True))
    same = tmp_path / "split.safetensors"
    save_file({k: v for m, part in split.items() for k, v in (
        (f"transformer.single_transformer_blocks.0.{m}.lora_A.weight", a.clone()),
        (f"transformer.single_transformer_blocks.0.{m}.lora_B.weight", part * alpha / 4))}, same)
    assert_matches(read(kohya), loaded(FLUX, same), expect={f"single_transformer_blocks.0.{m}" for m in split})


@pytest.mark.parametrize("world_size", [2])
def test_linear1_shards_heads_and_mlp_rows(tmp_path, world_size):
    t = spec().targets["single_linear1"]
    assert [t.b_rows(s, 1, world_size) for s in range(4)] == [(8, 16), (8, 16), (8, 16), (32, 64)]
