"""A config's rules matched once per template (checkpoint.module_rules) are the rules it gives every module
matched one by one (AdapterConfig.module_rules), for configs that cannot tell digits apart and for those
that can (which are matched one by one): names with layers and experts of one and two digits, newlines,
names that are digits alone."""

from __future__ import annotations

import pytest

from mstar.engine.resources.lora.adapter_config import parse_config
from mstar.engine.resources.lora.checkpoint import digit_blind, module_rules

NAMES = [f"base_model.model.model.layers.{layer}.{part}" for layer in (0, 1, 7, 10, 12, 31)
         for part in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj", "mlp.gate_up_proj",
                      *(f"mlp.experts.{e}.{p}" for e in (0, 3, 9, 11, 100) for p in ("gate_proj", "down_proj")))]
NAMES += ["lm_head", "layers.1", "model.7", "layers.1.\udc80q_proj", "layers.2.é.q_proj",
          "x.1.q_proj\n", "a.b\n.1.q_proj", "12", "layers.0.attn1.to_q",
          "layers.0.attn2.to_q", "layers.0.ff.net.0.proj", "layers.0.ff.net.2"]

CONFIGS = [
    {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj", "gate_proj"]},
    {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "rank_pattern": {"down_proj": 2, "mlp.gate_proj": 3,
                                                                          "layers...self_attn.q_proj": 1,
                                                                          "experts....gate_proj": 5},
     "alpha_pattern": {"o_proj": 5, "experts.gate_proj": 7, "s.q_proj": 9}},
    {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "o_proj"], "exclude_modules": ["mlp"],
     "rank_pattern": {"self_attn.q_proj": 4, "q-proj": 1, "l.q_proj": 2}},
    {"r": 2, "lora_alpha": 2, "target_modules": ["q_proj"], "target_parameters": ["mlp.experts.gate_up_proj"]},
    {"r": 2, "lora_alpha": 4, "use_rslora": True, "target_modules": ["to_q", "proj"],
     "rank_pattern": {"attn.to_q": 3, "ff.net..proj": 1, "s...mlp": 6}},
    # configs that tell digits apart: matched module by module
    {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "rank_pattern": {"layers.1.self_attn.q_proj": 2}},
    {"r": 4, "lora_alpha": 8, "target_modules": ["1.self_attn.q_proj", "down_proj"]},
    {"r": 4, "lora_alpha": 8, "target_modules": r".*layers\.1\d?\..*"},
    {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "rank_pattern": {r"layers\.\d\.self_attn\.q_proj": 2}},
    {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"], "exclude_modules": r".*\.experts\.1.*"},
    {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "alpha_pattern": {"layers.1.mlp": 3}},
    {"r": 4, "lora_alpha": 8, "target_modules": ["gate_proj"], "target_parameters": ["layers.1.mlp.experts"]},
]


@pytest.mark.parametrize("raw", CONFIGS)
def test_rules_by_template_are_the_rules_module_by_module(raw):
    config = parse_config({"peft_type": "LORA", **raw})
    assert module_rules(config, NAMES) == config.module_rules(NAMES)


def test_a_dotted_key_tells_one_digit_from_two_by_template_too():
    config = parse_config({"peft_type": "LORA", **CONFIGS[1]})
    rules = module_rules(config, NAMES)
    assert rules["base_model.model.model.layers.7.self_attn.q_proj"].rank == 1
    assert rules["base_model.model.model.layers.10.self_attn.q_proj"].rank == 4
    assert rules["base_model.model.model.layers.10.mlp.experts.11.gate_proj"].rank == 5
    assert rules["base_model.model.model.layers.10.mlp.experts.3.gate_proj"].rank == 4


def test_configs_naming_digits_are_not_matched_by_template():
    blind = [digit_blind(parse_config({"peft_type": "LORA", **raw})) for raw in CONFIGS]
    assert blind == [True] * 5 + [False] * 7
