"""Adapters as the trainers in the wild write them: each gives the delta diffusers applies after loading it,
or where diffusers does not read the format, the delta the trainer's own loading rule (written out here) gives."""

from __future__ import annotations

import json

import pytest
import torch
from diffusion import FLUX, WAN, WAN_TARGETS, loaded, native, save_wan_lora
from reference import lora_modules, peft_delta, slot_delta
from safetensors.torch import load_file, save_file
from tiny import make_adapter, model_config, write_config

from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file, specs_from_config
from mstar.engine.resources.lora.tools.cli import main

DIM, MLP = 16, 64
WAN_TOP = ["time_embedder.linear_1", "time_embedder.linear_2", "time_proj", "text_embedder.linear_1",
           "text_embedder.linear_2", "proj_out"]


def read(config, file):
    spec = next(iter(specs_from_config(config, max_rank=8).values()))
    digest = check_adapter_file(spec, "ad", file)
    return spec, LoraAdapterStore(spec, pin=False, dtype=torch.float32).read("ad", file, digest)


def assert_gives(config, file, deltas):
    """Every module in deltas (name -> (module input maker, its delta function)) gets that delta from the pool."""
    spec, adapter = read(config, file)
    g = torch.Generator().manual_seed(0)
    for module, (fan_in, delta) in deltas.items():
        x = torch.randn(3, fan_in, generator=g)
        got = slot_delta(adapter.a, adapter.b, adapter.scaling, spec, module, x)
        torch.testing.assert_close(got, delta(x), rtol=1e-5, atol=1e-6, msg=module)
    return adapter


def assert_as_diffusers_loads(config, file, expect=None, includes=()):
    """The pool's delta for every module diffusers loads from file is diffusers' own (which loads expect,
    or at least includes)."""
    model = loaded(config, file)
    layers = lora_modules(model)
    assert layers, "diffusers loaded the file"
    deltas = {m: (layer.base_layer.in_features, lambda x, layer=layer: peft_delta(layer, x))
              for m, layer in layers.items()}
    adapter = assert_gives(config, file, deltas)
    if expect is not None:
        assert set(layers) == expect
    assert set(includes) <= set(layers), f"diffusers loaded {sorted(layers)}"
    return adapter


# --- 1, integer alphas -------------------------------------------------------------------------------

@pytest.mark.parametrize("style", ["native", "kohya"])
def test_integer_alphas_are_read_as_kohya_diffusers_and_comfyui_read_them(tmp_path, style):
    diffusers_file = save_wan_lora(tmp_path / "d", target_modules=WAN_TARGETS)
    file = native(diffusers_file, tmp_path / "int.safetensors", style, alpha_dtype=torch.int64)
    assert {v.dtype for k, v in load_file(file).items() if k.endswith(".alpha")} == {torch.int64}
    assert_as_diffusers_loads(WAN, file)


# --- 2, one bad adapter does not stop the command line -----------------------------------------------

def test_check_and_inspect_name_every_adapter_though_one_cannot_be_inspected(tmp_path, capsys):
    config = write_config(tmp_path, model_config("llama"))
    _, good = make_adapter(tmp_path, name="good")
    _, big = make_adapter(tmp_path, name="big", r=16)
    bad = tmp_path / "nan.safetensors"
    save_file({"diffusion_model.x.lora_down.weight": torch.zeros(2, 64), "diffusion_model.x.lora_up.weight":
               torch.zeros(64, 2), "diffusion_model.x.alpha": torch.tensor(float("nan"))}, bad)
    for command in ("check", "inspect"):
        assert main([command, str(config), str(bad), str(good), str(big), "--max-rank", "8"]) == 1
        out, err = capsys.readouterr()
        lines = [line.split()[0] for line in out.splitlines()[1:4]]
        assert lines == ["nan", "good", "big"], f"{command} tabulates every adapter"
        assert "alpha nan is not a finite" in out + err and "rank 16" in out + err


# --- 3, DiffSynth-Studio's Wan LoRAs -----------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["", "pipe.dit."])
def test_diffsynth_wan_keys_give_diffsynths_delta(tmp_path, prefix):
    """DiffSynth-Studio saves PEFT's factors under the Wan model's own names, with PEFT's adapter name in
    the key; its loader adds B A at weight 1 (no alpha), which is the pool's rule for a file with none."""
    g = torch.Generator().manual_seed(1)
    factors = {}
    for block in range(2):
        for name, fan_in, fan_out in (("self_attn.q", DIM, DIM), ("cross_attn.k", DIM, DIM), ("ffn.0", DIM, 32),
                                      ("ffn.2", 32, DIM)):
            factors[f"blocks.{block}.{name}"] = (torch.randn(4, fan_in, generator=g),
                                                  torch.randn(fan_out, 4, generator=g) * 0.1)
    tensors = {f"{prefix}{m}.lora_{r}.default.weight": w for m, (a, b) in factors.items()
               for r, w in (("A", a), ("B", b))}
    file = tmp_path / "diffsynth.safetensors"
    save_file(tensors, file)
    to = {"self_attn.q": "attn1.to_q", "cross_attn.k": "attn2.to_k", "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2"}
    deltas = {}
    for m, (a, b) in factors.items():
        _, block, name = m.split(".", 2)
        deltas[f"blocks.{block}.{to[name]}"] = (a.shape[1], lambda x, a=a, b=b: x @ a.T @ b.T)
    adapter = assert_gives(WAN, file, deltas)
    plain = tmp_path / "plain.safetensors"
    save_file({k.replace(".default", "").removeprefix(prefix): v for k, v in tensors.items()}, plain)
    assert read(WAN, plain)[1].digest == adapter.digest, "the same weights without .default"


# --- 4, XLabs' FLUX LoRAs ----------------------------------------------------------------------------

def test_xlabs_flux_keys_are_served_as_diffusers_loads_them(tmp_path):
    g = torch.Generator().manual_seed(2)
    shapes = {f"{block}.processor.{name}": dims for block, name, dims in (
        ("double_blocks.0", "qkv_lora1", (DIM, 3 * DIM)), ("double_blocks.0", "proj_lora1", (DIM, DIM)),
        ("double_blocks.0", "qkv_lora2", (DIM, 3 * DIM)), ("double_blocks.0", "proj_lora2", (DIM, DIM)),
        ("single_blocks.0", "qkv_lora", (DIM, 3 * DIM)), ("single_blocks.0", "proj_lora", (DIM + MLP, DIM)))}
    tensors = {}
    for module, (fan_in, fan_out) in shapes.items():
        tensors[f"{module}.down.weight"] = torch.randn(4, fan_in, generator=g)
        tensors[f"{module}.up.weight"] = torch.randn(fan_out, 4, generator=g) * 0.1
    file = tmp_path / "xlabs.safetensors"
    save_file(tensors, file)
    loads = [f"transformer_blocks.0.attn.{m}" for m in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj",
                                                         "add_k_proj", "add_v_proj", "to_add_out")]
    loads += [f"single_transformer_blocks.0.{m}" for m in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_out")]
    adapter = assert_as_diffusers_loads(FLUX, file, expect=set(loads))
    assert set(adapter.a) == {"img_qkv", "img_out", "txt_qkv", "txt_out", "single_linear1", "single_linear2"}
    b = adapter.b["single_linear1"][0]
    assert b[3 * DIM :].abs().sum() == 0, "XLabs' single-block qkv leaves the MLP slice of linear1 alone"


# --- 5, every linear trainers put LoRA on ------------------------------------------------------------

def test_flux_embedders_and_final_layer_in_kohyas_layout(tmp_path):
    """ComfyUI's extraction and kohya train time_in, vector_in, txt_in, img_in and final_layer too.
    diffusers' kohya loader drops most of these in a model this small, so the reference is kohya's rule
    (B A at alpha / rank; no alpha: 1) on diffusers' module, with BFL's final adaLN's halves swapped, as
    diffusers' swap_scale_shift does: BFL's holds shift then scale, diffusers' scale then shift."""
    g = torch.Generator().manual_seed(4)
    modules = {"time_in_in_layer": ("time_text_embed.timestep_embedder.linear_1", 256, DIM),
               "time_in_out_layer": ("time_text_embed.timestep_embedder.linear_2", DIM, DIM),
               "vector_in_in_layer": ("time_text_embed.text_embedder.linear_1", 16, DIM),
               "vector_in_out_layer": ("time_text_embed.text_embedder.linear_2", DIM, DIM),
               "txt_in": ("context_embedder", 16, DIM), "img_in": ("x_embedder", 8, DIM),
               "final_layer_adaLN_modulation_1": ("norm_out.linear", DIM, 2 * DIM),
               "final_layer_linear": ("proj_out", DIM, 8)}
    tensors, deltas = {}, {}
    for i, (kohya, (ours, fan_in, fan_out)) in enumerate(modules.items()):
        a, b = torch.randn(4, fan_in, generator=g), torch.randn(fan_out, 4, generator=g) * 0.1
        alpha = 2.0 + i
        tensors |= {f"lora_unet_{kohya}.lora_down.weight": a, f"lora_unet_{kohya}.lora_up.weight": b,
                    f"lora_unet_{kohya}.alpha": torch.tensor(alpha)}
        if kohya.startswith("final_layer_adaLN"):
            shift, scale = b.chunk(2)
            b = torch.cat([scale, shift])
        deltas[ours] = (fan_in, lambda x, a=a, b=b, s=alpha / 4: s * x @ a.T @ b.T)
    file = tmp_path / "kohya.safetensors"
    save_file(tensors, file)
    adapter = assert_gives(FLUX, file, deltas)
    assert {"time_embedder_1", "time_embedder_2", "text_embedder_1", "text_embedder_2", "context_embedder",
            "x_embedder", "norm_out", "proj_out"} == set(adapter.a)


def test_wan_condition_embedders_and_head_in_diffusers_and_native_layouts(tmp_path):
    diffusers_file = save_wan_lora(tmp_path / "d", target_modules=[*WAN_TARGETS, *WAN_TOP])
    top = [f"condition_embedder.{m}" for m in WAN_TOP[:-1]] + ["proj_out"]
    adapter = assert_as_diffusers_loads(WAN, diffusers_file, includes=top)
    assert {"time_embedder_1", "time_embedder_2", "time_proj", "text_embedder_1", "text_embedder_2",
            "proj_out"} <= set(adapter.a)
    # diffusers' converter takes no alpha outside the blocks, so the native file here carries none
    assert_as_diffusers_loads(WAN, native(diffusers_file, tmp_path / "n.safetensors", "native", alphas=False),
                              includes=top)


# --- 6, other layouts diffusers converts -------------------------------------------------------------

def test_flux_mixture_keys_are_served_as_diffusers_loads_them(tmp_path):
    g = torch.Generator().manual_seed(6)
    shapes = {"transformer_blocks_0_attn_to_q": (DIM, DIM), "transformer_blocks_0_attn_to_add_out": (DIM, DIM),
              "single_transformer_blocks_0_attn_to_k": (DIM, DIM), "context_embedder": (16, DIM),
              "time_text_embed_timestep_embedder_linear_1": (256, DIM)}
    tensors = {}
    for i, (module, (fan_in, fan_out)) in enumerate(shapes.items()):
        tensors[f"lora_transformer_{module}.lora_down.weight"] = torch.randn(4, fan_in, generator=g)
        tensors[f"lora_transformer_{module}.lora_up.weight"] = torch.randn(fan_out, 4, generator=g) * 0.1
        tensors[f"lora_transformer_{module}.alpha"] = torch.tensor(2.0 + i)
    file = tmp_path / "mixture.safetensors"
    save_file(tensors, file)
    expect = {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_add_out", "context_embedder",
              "single_transformer_blocks.0.attn.to_k", "time_text_embed.timestep_embedder.linear_1"}
    assert_as_diffusers_loads(FLUX, file, expect=expect)


def test_videox_fun_double_underscore_keys_are_musubis(tmp_path):
    """VideoX-Fun writes kohya's keys with one more underscore (lora_unet__blocks_0_...); ComfyUI reads
    them by dropping it, so the same weights under lora_unet_ are the reference."""
    diffusers_file = save_wan_lora(tmp_path / "d", target_modules=WAN_TARGETS)
    musubi = native(diffusers_file, tmp_path / "k.safetensors", "kohya")
    fun = tmp_path / "fun.safetensors"
    save_file({k.replace("lora_unet_", "lora_unet__", 1): v for k, v in load_file(musubi).items()}, fun)
    a, b = read(WAN, musubi)[1], read(WAN, fun)[1]
    assert a.digest == b.digest and all(torch.equal(a.b[t], b.b[t]) for t in a.b)


# --- 7, configs that are not PEFT's ------------------------------------------------------------------

def test_an_mlx_lm_adapter_config_is_refused_for_what_it_is(tmp_path):
    _, path = make_adapter(tmp_path)
    (path / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 3, "lora_parameters": {"rank": 4, "scale": 20.0, "dropout": 0.0}}))
    spec = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
    with pytest.raises(ValueError, match=r"adapter_config.json is mlx-lm's \(lora_parameters, fine_tune_type\), "
                                         r"not PEFT's"):
        check_adapter_file(spec, "mlx", path)
