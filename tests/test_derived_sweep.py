"""The sweep: tiny models of every family issue 25 lists, from transformers' own config classes, with PEFT's
own all-linear adapter (and target_parameters on the stacked experts), each module's delta from the derived
spec's slots against PEFT's, at world size 1 and, where the plan shards, 2 and 4 (the shards put back
together). Under a second a family on one core; a family no builder knows is derived from its config.json dict,
as `mstar-lora check MODEL_FOLDER` reads it."""

from __future__ import annotations

import pytest
from derived import all_linear_adapter, assert_serves_peft, build, tiny_config

from mstar.engine.resources.lora.models import BUILDERS, specs_from_config
from mstar.engine.resources.lora.models.derived import specs_from_model

MAMBA = {"exclude_modules": ["out_proj", "conv1d"]}  # PEFT refuses LoRA on a Mamba mixer's out_proj and conv
# family -> LoRA options beside all-linear
FAMILIES = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {}, "gemma": {}, "gemma2": {}, "phi3": {}, "gpt_oss": {},
    "qwen3_moe": {}, "mixtral": {}, "qwen2_vl": {}, "qwen2_5_vl": {},
    "qwen3_next": {}, "qwen3_5": {}, "qwen3_5_moe": {}, "gemma3_text": {}, "gemma3": {}, "gemma4_text": {},
    "gemma4": {}, "deepseek_v2": {}, "deepseek_v3": {}, "glm4": {}, "glm4_moe": {}, "olmo2": {}, "olmo3": {},
    "olmoe": {}, "granite": {}, "granitemoe": {}, "granitemoehybrid": {}, "cohere2": {}, "starcoder2": {},
    "falcon_h1": MAMBA, "nemotron_h": MAMBA, "lfm2": {}, "llama4_text": {}, "llama4": {}, "ernie4_5": {},
    "ernie4_5_moe": {}, "hunyuan_v1_dense": {}, "hunyuan_v1_moe": {}, "minimax": {}, "minimax_m2": {},
    "seed_oss": {}, "smollm3": {}, "phimoe": {}, "qwen3_vl": {}, "qwen3_vl_moe": {}, "mllama": {},
}


# family -> config fields beside the shrunk sizes: hybrids whose tiny defaults would have one kind of layer
CONFIGS = {"lfm2": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
           "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba", "attention"]}}
FAMILIES["granitemoehybrid"] = MAMBA


def derived(family: str, config):
    """The derived spec as a deployment gets it: from the config.json's dict, as `mstar-lora check MODEL_FOLDER`
    reads it, for a family no builder knows; from the model for one a builder knows."""
    if family in BUILDERS:
        return specs_from_model(build(config, device="meta"), max_rank=4)
    return specs_from_config(config.to_dict(), max_rank=4)


def world_sizes(specs) -> list[int]:
    shards = any(t.parallel != "replicated" for s in specs.values() for t in s.targets.values())
    return [1, 2, 4] if shards else [1]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_all_linear_is_served_with_peft_delta_at_every_world_size(tmp_path, family):
    config = tiny_config(family, **CONFIGS.get(family, {}))
    pm, path = all_linear_adapter(tmp_path, build(config), **FAMILIES[family])
    specs = derived(family, config)
    for world_size in world_sizes(specs):
        assert assert_serves_peft(pm, specs, path, world_size)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f in (
    "gpt_oss", "qwen3_moe", "mixtral", "qwen3_next", "qwen3_5_moe", "deepseek_v2", "deepseek_v3", "glm4_moe",
    "olmoe", "granitemoe", "granitemoehybrid", "nemotron_h", "llama4_text", "ernie4_5_moe", "hunyuan_v1_moe",
    "minimax", "minimax_m2", "phimoe", "qwen3_vl_moe")])
def test_stacked_experts_by_target_parameters_are_served_with_peft_delta(tmp_path, family):
    config = tiny_config(family, **CONFIGS.get(family, {}))
    specs = derived(family, config)
    stacked = sorted({n.rpartition("*.")[2] for n in specs["experts"].targets})
    pm, path = all_linear_adapter(tmp_path, build(config), target_modules=[], target_parameters=stacked)
    for world_size in (1, 2):
        checked = assert_serves_peft(pm, specs, path, world_size)
        assert {m.rpartition(".")[2] for m in checked} == {s.rpartition(".")[2] for s in stacked}


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3", "mllama", "falcon_h1", "lfm2"])
def test_a_config_no_builder_knows_falls_back_to_the_spec_derived_from_it(family):
    """What specs_from_config gives a config.json's dict is what the model built from it derives."""
    config = tiny_config(family, **CONFIGS.get(family, {}))
    got = specs_from_config(config.to_dict(), max_rank=4)
    want = specs_from_model(build(config, device="meta"), max_rank=4)
    assert {n: (dict(s.targets), s.patterns) for n, s in got.items()} == \
        {n: (dict(s.targets), s.patterns) for n, s in want.items()}
