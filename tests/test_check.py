"""The startup check: what it accepts, and each refusal with its own reason."""

from __future__ import annotations

import json
import re

import pytest
import safetensors.torch
import torch
from reference import VISION_MODULES
from tiny import LM_TARGETS, make_adapter, model_config

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.store import (
    adapter_targets,
    as_linear,
    check_adapter_file,
    check_adapters,
    inspect_adapter,
    inspect_keys,
    misfit,
)


def lm_spec(arch="llama", max_rank=8, **over):
    return specs_from_config(model_config(arch, **over), max_rank=max_rank)["language_model"]


def refused(spec, path, *pattern, others=(), name="ad"):
    with pytest.raises(ValueError) as e:
        check_adapter_file(spec, name, path, others)
    msg = str(e.value)
    assert f"adapter {name!r}" in msg and str(path).split("/")[-1] in msg
    for p in pattern:
        assert re.search(p, msg), f"{p!r} not in {msg}"
    return msg


def test_accepts_all_linear_targets_and_reports_them(tmp_path):
    _, path = make_adapter(tmp_path)
    spec = lm_spec()
    info = inspect_adapter(spec, path)
    assert info.rank == 4 and not info.unmapped and not info.misfits
    assert adapter_targets(spec, path) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert len(check_adapter_file(spec, "ad", path)) == 32


def test_accepts_the_safetensors_file_as_well_as_its_directory(tmp_path):
    _, path = make_adapter(tmp_path)
    spec = lm_spec()
    assert check_adapter_file(spec, "ad", path / "adapter_model.safetensors") == check_adapter_file(spec, "ad", path)


def test_subset_of_targets_and_layers(tmp_path):
    _, path = make_adapter(tmp_path, target_modules=["v_proj", "down_proj"], layers_to_transform=[2])
    assert adapter_targets(lm_spec(), path) == {"qkv_proj", "down_proj"}
    check_adapter_file(lm_spec(), "ad", path)


def test_vision_adapter_accepted_only_with_the_vision_spec_among_others(tmp_path):
    _, path = make_adapter(tmp_path, "qwen2_vl", target_modules=LM_TARGETS + VISION_MODULES)
    specs = specs_from_config(model_config("qwen2_vl"), max_rank=8)
    lm, vision = specs["language_model"], specs["vision_tower"]
    assert adapter_targets(vision, path) == {"qkv", "proj", "fc1", "fc2", "patch_embed", "merger_fc1", "merger_fc2"}
    assert "model.visual.patch_embed.proj" in inspect_adapter(lm, path).unmapped
    refused(lm, path, r"module model\.visual\.blocks\.0\.attn\.proj: no target of language_model maps it "
                      r"\(and 10 more modules alike\)")
    assert check_adapter_file(lm, "ad", path, [vision]) == check_adapter_file(vision, "ad", path, [lm])


def test_older_module_layout_of_qwen2_vl_resolves():
    spec = specs_from_config(model_config("qwen2_vl"), max_rank=8)
    assert spec["language_model"].locate("model.layers.2.self_attn.k_proj") == ("qkv_proj", 2, 1)
    assert spec["language_model"].locate("model.language_model.layers.2.self_attn.k_proj") == ("qkv_proj", 2, 1)
    assert spec["vision_tower"].locate("visual.blocks.1.attn.qkv") == ("qkv", 1, None)
    assert spec["vision_tower"].locate("model.visual.blocks.1.attn.qkv") == ("qkv", 1, None)
    assert spec["vision_tower"].locate("visual.patch_embed.proj") == ("patch_embed", 0, None)
    assert spec["vision_tower"].locate("visual.merger.mlp.0") == ("merger_fc1", 0, None)


def test_refuses_rank_over_max_rank(tmp_path):
    _, path = make_adapter(tmp_path, r=16)
    refused(lm_spec(max_rank=8), path,
            r"model\.layers\.0\.mlp\.down_proj: rank 16, over this pool's max_rank 8 \(and 20 more modules alike\)")


def test_refuses_dora(tmp_path):
    _, path = make_adapter(tmp_path, use_dora=True)
    refused(lm_spec(), path, "DoRA")


def test_refuses_lm_head_lora(tmp_path):
    _, path = make_adapter(tmp_path, target_modules=["q_proj", "lm_head"])
    refused(lm_spec(), path, r"module lm_head: LoRA on lm_head is not served")


def test_refuses_embedding_lora(tmp_path):
    _, path = make_adapter(tmp_path, target_modules=["q_proj", "embed_tokens"])
    refused(lm_spec(), path, "embed_tokens: LoRA on an embedding is not served")


def test_refuses_modules_to_save(tmp_path):
    _, path = make_adapter(tmp_path, modules_to_save=["lm_head"])
    refused(lm_spec(), path, "modules_to_save")


def test_refuses_trained_biases(tmp_path):
    _, path = make_adapter(tmp_path, bias="all", config=model_config("qwen2"))
    refused(lm_spec("qwen2"), path, "bias 'all' trains biases")


def test_refuses_lora_bias(tmp_path):
    _, path = make_adapter(tmp_path, lora_bias=True)
    refused(lm_spec(), path, "lora_bias")


def test_refuses_modules_no_spec_maps(tmp_path):
    """The merger's linears are the vision tower's: a deployment serving the language model alone refuses them."""
    _, path = make_adapter(tmp_path, "qwen2_vl", target_modules=["q_proj", "merger.mlp.0"])
    specs = specs_from_config(model_config("qwen2_vl"), max_rank=8)
    refused(specs["language_model"], path, r"model\.visual\.merger\.mlp\.0: no target of language_model maps it")
    check_adapter_file(specs["language_model"], "ad", path, [specs["vision_tower"]])


def test_refuses_shapes_of_a_differently_sized_model(tmp_path):
    _, path = make_adapter(tmp_path)
    msg = refused(lm_spec(hidden_size=128), path,
                  r"k_proj: A \[4, 64\] takes 64 inputs, target qkv_proj takes 128 \(and 8 more")
    assert "gate_proj" in msg and "down_proj" in msg, "every misfitting module is named in one error"


def test_refuses_layers_past_the_model(tmp_path):
    _, path = make_adapter(tmp_path)
    refused(lm_spec(num_hidden_layers=2), path, r"layer 2 is past the 2 layers")


def test_refuses_a_conv_kernel_that_differs(tmp_path):
    _, path = make_adapter(tmp_path, "qwen2_vl", target_modules=["patch_embed.proj"])
    config = model_config("qwen2_vl")
    config["vision_config"].update(temporal_patch_size=8, patch_size=2)  # same 96 inputs, another kernel
    spec = specs_from_config(config, max_rank=8)["vision_tower"]
    refused(spec, path, r"A \[4, 3, 2, 4, 4\] needs \[r, 3, 8, 2, 2\] for the conv target patch_embed")


def test_refuses_only_adapter_model_bin(tmp_path):
    pm, _path = make_adapter(tmp_path)
    pm.save_pretrained(tmp_path / "bin", safe_serialization=False)
    refused(lm_spec(), tmp_path / "bin", "only adapter_model.bin")


def test_refuses_no_config(tmp_path):
    _, path = make_adapter(tmp_path)
    (path / "adapter_config.json").unlink()
    refused(lm_spec(), path, "no adapter_config.json")


def test_refuses_malformed_config(tmp_path):
    _, path = make_adapter(tmp_path)
    (path / "adapter_config.json").write_text("{not json")
    refused(lm_spec(), path, "adapter_config.json is not valid JSON")


def test_refuses_other_peft_types(tmp_path):
    _, path = make_adapter(tmp_path)
    raw = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**raw, "peft_type": "LOHA"}))
    refused(lm_spec(), path, "peft_type 'LOHA' is not LoRA")


def test_refuses_a_rank_the_config_does_not_give(tmp_path):
    _, path = make_adapter(tmp_path)
    raw = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**raw, "r": 8}))
    refused(lm_spec(), path, r"rank 4, but adapter_config\.json gives it r=8")


def test_refuses_two_spellings_of_one_module(tmp_path):
    _, path = make_adapter(tmp_path, target_modules=["q_proj"])
    file = path / "adapter_model.safetensors"
    tensors = safetensors.torch.load_file(file)
    for k, v in list(tensors.items()):
        tensors[k.replace("model.model.layers", "model.model.language_model.layers")] = v.clone()
    safetensors.torch.save_file(tensors, file)
    refused(lm_spec(), path, "fills the same weights as")


def test_refuses_an_adapter_with_no_weights(tmp_path):
    _, path = make_adapter(tmp_path)
    safetensors.torch.save_file({}, path / "adapter_model.safetensors")
    refused(lm_spec(), path, "it holds no weights")


def test_check_adapters_names_every_bad_adapter(tmp_path):
    _, good = make_adapter(tmp_path, name="good")
    _, big = make_adapter(tmp_path, name="big", r=16)
    _, dora = make_adapter(tmp_path, name="dora", use_dora=True)
    spec = specs_from_config(model_config("llama"), max_rank=8,
                             adapters={"good": str(good), "big": str(big), "dora": str(dora)})["language_model"]
    with pytest.raises(ValueError) as e:
        check_adapters(spec)
    msg = str(e.value)
    assert "2 of 3 adapters" in msg and "adapter 'big'" in msg and "adapter 'dora'" in msg and "'good'" not in msg
    spec = specs_from_config(model_config("llama"), max_rank=8, adapters={"good": str(good)})["language_model"]
    assert set(check_adapters(spec)) == {"good"}


def test_inspect_keys_from_a_header_listing():
    spec = lm_spec()
    info = inspect_keys(spec, [
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", (4, 64)),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", (64, 4)),
        ("base_model.model.model.layers.1.mlp.up_proj.lora_A.weight", (6, 64)),
        ("base_model.model.model.layers.1.mlp.up_proj.lora_B.weight", (96, 5)),
        ("base_model.model.model.norm.lora_A.weight", (4, 64)),
        ("base_model.model.model.norm.lora_B.weight", (64, 4)),
    ])
    assert info.rank == 6 and info.unmapped == ("model.norm",) and info.targets == {"qkv_proj"}
    assert info.misfits == {"model.layers.1.mlp.up_proj": "B [96, 5] should be [96, 6] for target gate_up_proj"}


def test_as_linear_and_misfit_table():
    assert as_linear((8, 3, 2, 14, 14)) == (8, 3 * 2 * 14 * 14)
    assert as_linear((1280, 8, 1, 1, 1)) == (1280, 8)
    assert as_linear((8, 4096)) == (8, 4096)
    spec = lm_spec()
    assert misfit(spec, "model.layers.0.self_attn.v_proj", (4, 64), (32, 4)) is None
    assert misfit(spec, "model.layers.0.self_attn.v_proj", (4, 64), (64, 4)) == \
        "B [64, 4] should be [32, 4] for target qkv_proj"
    assert misfit(spec, "model.layers.0.self_attn.o_proj", (4, 64, 1), (64, 4, 1)) == \
        "A [4, 64, 1] is a conv factor, target o_proj is a linear"


def test_an_architecture_neither_a_builder_nor_transformers_knows_is_named():
    with pytest.raises(ValueError, match=r"unknown architecture .no-such-model.: neither a builder here nor "
                                         r"transformers [\d.]+ knows it"):
        specs_from_config({"model_type": "no-such-model"}, max_rank=8)


def test_adapters_saved_in_bf16_check_the_same_way(tmp_path):
    _, path = make_adapter(tmp_path, dtype=torch.bfloat16)
    assert not inspect_adapter(lm_spec(), path).misfits


def header_bytes(path):
    data = (path / "adapter_model.safetensors").read_bytes()
    return data[: 8 + int.from_bytes(data[:8], "little")]


def test_a_header_seen_before_is_judged_with_its_own_config(tmp_path):
    """Headers are parsed and inspected once per distinct bytes; the config still decides."""
    _, first = make_adapter(tmp_path, name="first")
    _, second = make_adapter(tmp_path, name="second", seed=5)  # same shapes: a byte-identical header
    assert header_bytes(first) == header_bytes(second)
    spec = lm_spec()
    check_adapter_file(spec, "first", first)
    raw = json.loads((second / "adapter_config.json").read_text())
    (second / "adapter_config.json").write_text(json.dumps({**raw, "r": 8}))
    refused(spec, second, r"rank 4, but adapter_config\.json gives it r=8", name="second")
    assert check_adapter_file(spec, "first", first) != check_adapter_file(spec, "x", make_adapter(
        tmp_path, name="third", seed=6)[1]), "weights still digest apart"
