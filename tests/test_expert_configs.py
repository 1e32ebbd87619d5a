"""A mixture of experts' count, read under whichever name its config has: the Hub's Qwen3-MoE configs say
num_experts, transformers 5 saves num_local_experts for every family; two names that differ are refused."""

from __future__ import annotations

import json

import peft
import pytest
import transformers
from moe import CONFIGS, STACKED, randomize

from mstar.engine.resources.lora import check_adapter_file, specs_from_config

CLASSES = {"qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig,
           "gpt_oss": transformers.GptOssConfig}
COUNTS = ("num_experts", "num_local_experts")


def expert_count(specs) -> int:
    return specs["experts"].targets["experts_down"].experts.count


@pytest.mark.parametrize("family", list(CLASSES))
def test_a_config_transformers_5_saved_serves_its_adapters(tmp_path, family):
    """The config.json transformers 5 writes, and an adapter PEFT made on the model built from it."""
    kw = {k: v for k, v in CONFIGS[family].items() if k not in ("model_type", *COUNTS)}
    config = CLASSES[family](**kw, num_local_experts=3)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "num_experts" not in saved and saved["num_local_experts"] == 3, "transformers 5's own layout"
    s = specs_from_config(tmp_path / "config.json", max_rank=8, max_expert_rank=4)
    assert expert_count(s) == 3
    assert expert_count(specs_from_config(config.to_dict(), max_rank=8)) == 3
    pm = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                             peft.LoraConfig(r=2, lora_alpha=4, target_parameters=STACKED))
    randomize(pm, 1)
    pm.save_pretrained(tmp_path / "ad")
    check_adapter_file(s["language_model"], "ad", tmp_path / "ad", [s["experts"]])


def test_the_hubs_qwen3_moe_config_names_num_experts():
    hub = specs_from_config("qwen3-30b-a3b", max_rank=8, max_expert_rank=2)  # the Hub's config.json, as it is
    assert expert_count(hub) == 128
    assert expert_count(specs_from_config(CONFIGS["qwen3_moe"], max_rank=8)) == CONFIGS["qwen3_moe"]["num_experts"]


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("name", COUNTS)
def test_every_family_reads_either_name(family, name):
    config = {k: v for k, v in CONFIGS[family].items() if k not in COUNTS}
    assert expert_count(specs_from_config({**config, name: 6}, max_rank=8)) == 6
    assert expert_count(specs_from_config({**config, **dict.fromkeys(COUNTS, 6)}, max_rank=8)) == 6


@pytest.mark.parametrize("family", list(CONFIGS))
def test_two_names_that_differ_are_refused(family):
    config = {k: v for k, v in CONFIGS[family].items() if k not in COUNTS}
    with pytest.raises(ValueError, match=r"config's num_experts 8 and num_local_experts 4 differ"):
        specs_from_config({**config, "num_experts": 8, "num_local_experts": 4}, max_rank=8)


@pytest.mark.parametrize(("over", "why"), [({}, r"config names no expert count \(num_experts or num_local_experts\)"),
                                           ({"num_experts": 0}, r"num_experts is 0, not a positive"),
                                           ({"num_local_experts": "8"}, r"num_local_experts is '8', not a positive"),
                                           ({"num_experts": True}, r"num_experts is True, not a positive")])
def test_a_count_that_is_missing_or_not_a_count_is_refused(over, why):
    config = {k: v for k, v in CONFIGS["mixtral"].items() if k not in COUNTS}
    with pytest.raises(ValueError, match=why):
        specs_from_config({**config, **over}, max_rank=8)
