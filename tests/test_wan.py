"""Wan LoRAs in the layouts people ship: each gives the delta diffusers itself applies after loading it."""

from __future__ import annotations

import json

import pytest
import torch
from diffusion import WAN, WAN_TARGETS, loaded, native, save_wan_lora
from reference import lora_modules, module_input, peft_delta, slot_delta
from safetensors.torch import load_file, save_file

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file, inspect_adapter


def spec():
    return specs_from_config(WAN, max_rank=8)["transformer"]


def assert_matches_diffusers(file):
    s = spec()
    digest = check_adapter_file(s, "wan", file)
    adapter = LoraAdapterStore(s, pin=False, dtype=torch.float32).read("wan", file, digest)
    modules = lora_modules(loaded(WAN, file))
    assert modules, "diffusers loaded the file"
    g = torch.Generator().manual_seed(0)
    for module, layer in modules.items():
        x = module_input(layer, 3, g)
        got = slot_delta(adapter.a, adapter.b, adapter.scaling, s, module, x.flatten(1))
        torch.testing.assert_close(got, peft_delta(layer, x), rtol=1e-5, atol=1e-6, msg=module)
    return adapter, set(modules)


@pytest.fixture
def diffusers_file(tmp_path):
    return save_wan_lora(tmp_path / "diffusers", target_modules=WAN_TARGETS, rank_pattern={"ffn.net.2": 2},
                         alpha_pattern={"to_out.0": 3})


def test_diffusers_layout_with_metadata_and_the_conv_patch_embedding(tmp_path):
    file = save_wan_lora(tmp_path / "d", target_modules=[*WAN_TARGETS, "patch_embedding"],
                         rank_pattern={"ffn.net.2": 2}, alpha_pattern={"to_out.0": 3})
    adapter, modules = assert_matches_diffusers(file)
    assert "patch_embedding" in modules and "patch_embedding" in adapter.a
    assert adapter.scaling == 2.0, "lora_alpha 8 / r 4 from the file's metadata"


def test_diffusers_layout_without_metadata_means_alpha_equals_rank(tmp_path, diffusers_file):
    bare = tmp_path / "bare.safetensors"
    save_file(load_file(diffusers_file), bare)  # the same keys, no __metadata__
    s = spec()
    assert LoraAdapterStore(s, pin=False).read("bare", bare).scaling == 1.0


@pytest.mark.parametrize("style", ["native", "kohya"])
def test_trainer_layouts_with_per_module_alphas(tmp_path, diffusers_file, style):
    file = native(diffusers_file, tmp_path / f"{style}.safetensors", style)
    adapter, modules = assert_matches_diffusers(file)
    assert len(modules) == 20 and set(adapter.a) == {"self_qkv", "self_out", "cross_q", "cross_kv", "cross_out",
                                                      "ffn_up", "ffn_down"}


def test_native_layout_without_alphas(tmp_path, diffusers_file):
    assert_matches_diffusers(native(diffusers_file, tmp_path / "n.safetensors", "native", alphas=False))


def test_the_digest_covers_what_is_served_after_conversion(tmp_path, diffusers_file):
    s = spec()
    a = native(diffusers_file, tmp_path / "n.safetensors", "native")
    b = native(diffusers_file, tmp_path / "k.safetensors", "kohya")
    assert check_adapter_file(s, "a", a) == check_adapter_file(s, "b", b), "same modules, weights and alphas"
    assert check_adapter_file(s, "d", diffusers_file) != check_adapter_file(s, "a", a), "other scalings"


def test_inspect_reads_alphas_only_through_the_scalings(tmp_path, diffusers_file):
    file = native(diffusers_file, tmp_path / "n.safetensors", "native")
    info = inspect_adapter(spec(), file)
    assert info.rank == 4 and not info.misfits and not info.unmapped


def test_kohya_names_not_in_the_model_are_refused_not_guessed(tmp_path, diffusers_file):
    file = native(diffusers_file, tmp_path / "k.safetensors", "kohya")
    tensors = load_file(file)
    tensors["lora_unet_blocks_7_self_attn_q.lora_down.weight"] = torch.zeros(4, 16)
    tensors["lora_unet_blocks_7_self_attn_q.lora_up.weight"] = torch.zeros(16, 4)
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"module lora_unet_blocks_7_self_attn_q: no target of transformer maps it"):
        check_adapter_file(spec(), "k", file)


NOT_LORA = {
    "loha": ({"hada_w1_a": (4, 16), "hada_w1_b": (4, 16), "hada_w2_a": (16, 4), "hada_w2_b": (4, 16)}, "LoHa"),
    "lokr": ({"lokr_w1": (4, 4), "lokr_w2": (4, 4)}, "LoKr"),
    "diff": ({"diff": (16, 16), "diff_b": (16,)}, "full weight delta"),
    "tucker": ({"lora_down.weight": (4, 16), "lora_up.weight": (16, 4), "lora_mid.weight": (4, 4, 1, 1)},
               "Tucker core"),
    "dora": ({"lora_down.weight": (4, 16), "lora_up.weight": (16, 4), "dora_scale": (16, 1)}, "DoRA"),
}


@pytest.mark.parametrize("fmt", list(NOT_LORA))
def test_formats_that_are_not_lora_are_refused_by_name(tmp_path, fmt):
    weights, reason = NOT_LORA[fmt]
    file = tmp_path / f"{fmt}.safetensors"
    save_file({f"diffusion_model.blocks.0.self_attn.q.{k}": torch.zeros(shape) for k, shape in weights.items()}, file)
    with pytest.raises(ValueError, match=rf"adapter '{fmt}' \(.*{fmt}\.safetensors\): module blocks\.0\.attn1\.to_q: "
                                         rf".*{reason}"):
        check_adapter_file(spec(), fmt, file)


def test_an_alpha_that_is_not_one_number_is_refused(tmp_path, diffusers_file):
    file = native(diffusers_file, tmp_path / "n.safetensors", "native")
    tensors = load_file(file)
    tensors["diffusion_model.blocks.0.ffn.0.alpha"] = torch.ones(2)
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.net\.0\.proj: alpha \[2\] is not one number"):
        check_adapter_file(spec(), "n", file)


def test_a_zero_alpha_means_alpha_equals_rank_as_kohya_reads_it(tmp_path, diffusers_file):
    without = native(diffusers_file, tmp_path / "without.safetensors", "native", alphas=False)
    tensors = load_file(without)
    tensors["diffusion_model.blocks.1.ffn.2.alpha"] = torch.tensor(0.0)
    zero = tmp_path / "zero.safetensors"
    save_file(tensors, zero)
    store = LoraAdapterStore(spec(), pin=False, dtype=torch.float32)
    a, b = store.read("without", without), store.read("zero", zero)
    assert a.scaling == b.scaling == 1.0
    assert all(torch.equal(a.b[t], b.b[t]) for t in a.b)


def test_ranks_in_the_files_metadata_config_are_checked_against_the_tensors(tmp_path, diffusers_file):
    """The metadata's LoraConfig decides scalings as adapter_config.json does, so it is checked alike."""
    from safetensors import safe_open

    with safe_open(diffusers_file, "pt") as f:
        metadata = f.metadata()
    config = json.loads(metadata["lora_adapter_metadata"])
    config["transformer.r"] = 8  # the tensors are rank 4 (2 for ffn.net.2, by its rank_pattern)
    lying = tmp_path / "lying.safetensors"
    save_file(load_file(diffusers_file), lying, metadata={**metadata, "lora_adapter_metadata": json.dumps(config)})
    with pytest.raises(ValueError, match=r"module blocks\.0\.attn1\.to_k: rank 4, but lora_adapter_metadata gives "
                                         r"it r=8, so its scaling is unknown"):
        check_adapter_file(spec(), "lying", lying)


def test_a_file_without_config_takes_the_scaling_most_modules_share(tmp_path, diffusers_file):
    """alpha / r is 2 in all but two modules, which keep their own scaling folded into B."""
    file = native(diffusers_file, tmp_path / "n.safetensors", "native", alphas=False)
    tensors = load_file(file)
    odd = {"blocks.0.ffn.0": 0.5, "blocks.1.self_attn.o": 3.0}  # native name -> its scaling
    for key, value in list(tensors.items()):
        if key.endswith(".lora_down.weight"):
            module = key.removeprefix("diffusion_model.").removesuffix(".lora_down.weight")
            tensors[f"diffusion_model.{module}.alpha"] = torch.tensor(value.shape[0] * odd.get(module, 2.0))
    save_file(tensors, file)
    adapter, _ = assert_matches_diffusers(file)
    assert adapter.scaling == 2.0
    ups = {k: v for k, v in tensors.items() if k.endswith("lora_up.weight")}
    b = adapter.b["ffn_up"][0, :, :4]
    torch.testing.assert_close(b, ups["diffusion_model.blocks.0.ffn.0.lora_up.weight"] * 0.25, rtol=0, atol=0)
    assert torch.equal(adapter.b["ffn_up"][1, :, :4], ups["diffusion_model.blocks.1.ffn.0.lora_up.weight"]), \
        "a module at the shared scaling is not folded"
