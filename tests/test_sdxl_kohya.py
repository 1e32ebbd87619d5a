"""SDXL LoRAs in kohya's layout, written by diffusers' convert_state_dict_to_kohya from PEFT adapters: the UNet's
served as diffusers' own loader loads them, module by module; its text encoders' served by the pipeline's
text-encoder nodes and refused by name without them; DoRA and LoHa refused naming the module. (~10 s.)"""

from __future__ import annotations

import pytest
import torch
from diffusion_models import SDXL_UNET, UNET_CONVS, model, sdxl_folder, text_encoder
from reference import lora_modules, peft_delta, slot_delta
from safetensors.torch import load_file, save_file

from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file, specs_from_config
from mstar.engine.resources.lora.tools.cli import main

TEXT = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def peft_state(module, targets, prefix, seed):
    """PEFT's adapter (lora_alpha = r, as the kohya converter writes alpha) on module, its factors random."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, target_modules=targets), module)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return {f"{prefix}.{k}": v for k, v in get_peft_model_state_dict(module).items()}


def kohya_file(path, unet=True, text=False):
    from diffusers.utils import convert_state_dict_to_kohya

    state = {}
    if unet:
        state |= peft_state(model(SDXL_UNET), _unet_targets(), "unet", 1)
    if text:
        state |= peft_state(text_encoder(), TEXT, "text_encoder", 2)
        state |= peft_state(text_encoder(projection=True), TEXT, "text_encoder_2", 3)
    save_file({k: v.contiguous() for k, v in convert_state_dict_to_kohya(state).items()}, path)
    return path


def _unet_targets():
    return ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out",
            "time_emb_proj", "linear_1", "linear_2", *UNET_CONVS]


def diffusers_unet(file):
    """A fresh UNet with file loaded as StableDiffusionXLPipeline.load_lora_weights loads a UNet's LoRA."""
    from diffusers import StableDiffusionXLPipeline as Pipe

    unet = model(SDXL_UNET)
    state, alphas = Pipe.lora_state_dict(str(file), unet_config=unet.config)
    Pipe.load_lora_into_unet(state, alphas, unet=unet)
    return unet


def patch_input(layer, g):
    base = layer.base_layer
    if isinstance(base, torch.nn.Conv2d):
        return torch.randn(3, base.in_channels, *base.kernel_size, generator=g)
    return torch.randn(3, base.in_features, generator=g)


def loaded_delta(layer, x):
    """The delta the loaded layer adds; a conv's on one patch, as its weight's delta over the flattened patch
    (a padded conv run on a lone patch would pad it)."""
    if isinstance(layer.base_layer, torch.nn.Conv2d):
        with torch.no_grad():
            return x.flatten(1) @ layer.get_delta_weight(layer.active_adapters[0]).flatten(1).T
    return peft_delta(layer, x)


def read(specs, file):
    nodes = list(specs.values())
    digest = check_adapter_file(nodes[0], "k", file, nodes[1:])
    return {n: LoraAdapterStore(s, pin=False, dtype=torch.float32).read("k", file, digest) for n, s in specs.items()}


def test_unet_kohya_file_matches_diffusers_load_lora_weights_module_by_module(tmp_path):
    file = kohya_file(tmp_path / "kohya.safetensors")
    spec = specs_from_config(SDXL_UNET, max_rank=4)["unet"]
    adapter = read({"unet": spec}, file)["unet"]
    loaded = lora_modules(diffusers_unet(file))
    assert len(loaded) > 100 and any(".resnets.0.conv1" in m for m in loaded), "diffusers loaded linears and convs"
    g = torch.Generator().manual_seed(0)
    for module, layer in loaded.items():
        x = patch_input(layer, g)
        got = slot_delta(adapter.a, adapter.b, adapter.scaling, spec, module, x.flatten(1))
        torch.testing.assert_close(got, loaded_delta(layer, x), rtol=1e-4, atol=1e-6, msg=module)
    # diffusers' loader drops its own converter's add_embedding keys (DESIGN.md); the file's weights are served
    tensors = load_file(file)
    for i in (1, 2):
        a, b = (tensors[f"lora_unet_add_embedding_linear_{i}.lora_{r}.weight"] for r in ("down", "up"))
        x = torch.randn(3, a.shape[1], generator=g)
        got = slot_delta(adapter.a, adapter.b, adapter.scaling, spec, f"add_embedding.linear_{i}", x)
        torch.testing.assert_close(got, x @ a.T @ b.T, rtol=1e-4, atol=1e-6)
        assert f"add_embedding.linear_{i}" not in loaded


def test_text_encoder_keys_are_refused_by_name_without_a_text_encoder_node(tmp_path):
    file = kohya_file(tmp_path / "both.safetensors", text=True)
    spec = specs_from_config(SDXL_UNET, max_rank=4)["unet"]
    with pytest.raises(ValueError, match=r"module text_encoder\.[a-z_.]*layers\.0\.mlp\.fc1: a text encoder's LoRA "
                                         r".* no text-encoder node is served \(.*\(and 23 more modules alike\)"):
        check_adapter_file(spec, "both", file)


def test_the_pipeline_folder_serves_text_encoders_on_their_nodes(tmp_path):
    file = kohya_file(tmp_path / "both.safetensors", text=True)
    specs = specs_from_config(sdxl_folder(tmp_path / "sdxl"), max_rank=4)
    assert list(specs) == ["unet", "text_encoder", "text_encoder_2"]
    adapters = read(specs, file)
    tensors = load_file(file)
    g = torch.Generator().manual_seed(0)
    for node, prefix, projection in (("text_encoder", "lora_te1_", False), ("text_encoder_2", "lora_te2_", True)):
        spec, adapter = specs[node], adapters[node]
        names = [n for n, _ in text_encoder(projection).named_modules()]
        for layer in range(2):
            name = next(n for n in names if n.endswith(f"layers.{layer}.mlp.fc1"))
            kohya = prefix + name.replace(".", "_")
            a, b = tensors[f"{kohya}.lora_down.weight"], tensors[f"{kohya}.lora_up.weight"]
            x = torch.randn(3, 16, generator=g)
            module = f"{node}.{name}"
            got = slot_delta(adapter.a, adapter.b, adapter.scaling, spec, module, x)
            torch.testing.assert_close(got, x @ a.T @ b.T, rtol=1e-4, atol=1e-6, msg=module)


@pytest.mark.parametrize(("weights", "reason"), [
    ({"lora_down.weight": (4, 64), "lora_up.weight": (64, 4), "dora_scale": (64, 1)}, "DoRA"),
    ({"hada_w1_a": (64, 4), "hada_w1_b": (4, 64), "hada_w2_a": (64, 4), "hada_w2_b": (4, 64)}, "LoHa"),
    ({"lokr_w1": (8, 8), "lokr_w2": (8, 8)}, "LoKr"),
])
def test_what_is_not_lora_is_refused_naming_the_unet_module(tmp_path, weights, reason):
    file = tmp_path / "odd.safetensors"
    name = "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn1_to_q"
    save_file({f"{name}.{k}": torch.zeros(shape) for k, shape in weights.items()}, file)
    spec = specs_from_config(SDXL_UNET, max_rank=4)["unet"]
    with pytest.raises(ValueError, match=rf"module mid_block\.attentions\.0\.transformer_blocks\.0\.attn1\.to_q: "
                                         rf".*{reason}"):
        check_adapter_file(spec, "odd", file)


def test_check_and_inspect_take_the_pipeline_folder_and_name_each_modules_node(tmp_path, capsys):
    file = kohya_file(tmp_path / "both.safetensors", text=True)
    folder = sdxl_folder(tmp_path / "sdxl")
    assert main(["check", str(folder), str(file), "--max-rank", "4"]) == 0
    assert main(["inspect", str(folder), str(file), "--max-rank", "4", "--json"]) == 0
    out = capsys.readouterr().out
    import json

    rows = json.loads(out[out.rindex("[\n  {"):])
    nodes = {m["module"]: m["node"] for m in rows[0]["modules"]}
    assert nodes["mid_block.attentions.0.transformer_blocks.0.attn1.to_q"] == "unet"
    assert {n for m, n in nodes.items() if m.startswith("text_encoder.")} == {"text_encoder"}
    assert {n for m, n in nodes.items() if m.startswith("text_encoder_2.")} == {"text_encoder_2"}
    assert sum(m.startswith("text_encoder") for m in nodes) == 24, "every text encoder module is served"


def test_kohya_names_the_unet_lacks_are_refused_by_name_not_guessed(tmp_path):
    file = tmp_path / "odd.safetensors"
    save_file({"lora_unet_down_blocks_9_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 64),
               "lora_unet_down_blocks_9_attentions_0_proj_in.lora_up.weight": torch.zeros(64, 4),
               "lora_unet_.lora_down.weight": torch.zeros(4, 64), "lora_unet_.lora_up.weight": torch.zeros(64, 4)},
              file)
    spec = specs_from_config(SDXL_UNET, max_rank=4)["unet"]
    with pytest.raises(ValueError, match=r"module lora_unet_: no target of unet maps it \(and 1 more module alike\)"):
        check_adapter_file(spec, "odd", file)


def sgm_name(kohya: str, per_block: int = SDXL_UNET["layers_per_block"]) -> str:
    """A diffusers-named kohya module (lora_unet_down_blocks_1_attentions_0_...) under SGM's block names, as
    kohya's sd-scripts write SDXL's: the inverse of the rules diffusers' _maybe_map_sgm_blocks_to_diffusers and
    _convert_unet_lora_key read them by."""
    import re

    name = kohya.removeprefix("lora_unet_")
    resnet = {"conv1": "in_layers_2", "conv2": "out_layers_3", "time_emb_proj": "emb_layers_1",
              "conv_shortcut": "skip_connection"}
    top = {"conv_in": "input_blocks_0_0", "conv_out": "out_2", "time_embedding_linear_1": "time_embed_0",
           "time_embedding_linear_2": "time_embed_2", "add_embedding_linear_1": "label_emb_0_0",
           "add_embedding_linear_2": "label_emb_0_2"}
    if name in top:
        return "lora_unet_" + top[name]
    m = re.fullmatch(r"(down|up)_blocks_(\d+)_(resnets|attentions|downsamplers|upsamplers)_(\d+)_(.+)", name)
    mid = re.fullmatch(r"mid_block_(resnets|attentions)_(\d+)_(.+)", name)
    if mid:
        kind, i, rest = mid.groups()
        block = {"resnets": {"0": 0, "1": 2}, "attentions": {"0": 1}}[kind][i]
        return f"lora_unet_middle_block_{block}_{resnet.get(rest, rest)}"
    side, b, kind, i, rest = m.groups()
    b, i = int(b), int(i)
    if kind == "downsamplers":
        return f"lora_unet_input_blocks_{b * (per_block + 1) + per_block + 1}_0_op"
    if kind == "upsamplers":
        return f"lora_unet_output_blocks_{b * (per_block + 1) + per_block}_2_{rest}"
    inner = {"resnets": 0, "attentions": 1}[kind]
    index = b * (per_block + 1) + i + (1 if side == "down" else 0)
    return f"lora_unet_{'input' if side == 'down' else 'output'}_blocks_{index}_{inner}_{resnet.get(rest, rest)}"


def test_sgm_block_names_as_kohyas_sdxl_scripts_write_them_match_diffusers(tmp_path):
    """The same weights under SGM's names load into the same modules in diffusers (with the UNet's config), and
    the pool serves them there, alpha and all."""
    file = kohya_file(tmp_path / "kohya.safetensors")
    tensors = load_file(file)
    sgm = {f"{sgm_name(k.partition('.')[0])}.{k.partition('.')[2]}": v for k, v in tensors.items()}
    assert len(sgm) == len(tensors) and any("input_blocks_3_1_transformer" in k for k in sgm)
    save_file(sgm, tmp_path / "sgm.safetensors")
    loaded = lora_modules(diffusers_unet(tmp_path / "sgm.safetensors"))
    add = {"add_embedding.linear_1", "add_embedding.linear_2"}  # diffusers drops them but for SGM's label_emb
    assert set(loaded) == set(lora_modules(diffusers_unet(file))) | add, "SGM's names read as the same modules"
    spec = specs_from_config(SDXL_UNET, max_rank=4)["unet"]
    adapter = read({"unet": spec}, tmp_path / "sgm.safetensors")["unet"]
    assert adapter.digest == read({"unet": spec}, file)["unet"].digest, "the same modules, weights and scalings"
    g = torch.Generator().manual_seed(0)
    for module, layer in loaded.items():
        x = patch_input(layer, g)
        got = slot_delta(adapter.a, adapter.b, adapter.scaling, spec, module, x.flatten(1))
        torch.testing.assert_close(got, loaded_delta(layer, x), rtol=1e-4, atol=1e-6, msg=module)
