"""The spec derived from the model itself serves PEFT's own all-linear adapters with PEFT's deltas, for
architectures no builder here knows, and config-only architectures fall back to it."""

from __future__ import annotations

import pytest
from derived import all_linear_adapter, assert_serves_peft, build, tiny_config

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.models.derived import specs_from_model

CORE = ["llama", "olmo2", "starcoder2", "cohere2", "granite", "smollm3", "phi3"]


@pytest.mark.parametrize("family", CORE)
def test_a_derived_spec_serves_peft_all_linear_with_its_delta(tmp_path, family):
    config = tiny_config(family)
    pm, path = all_linear_adapter(tmp_path, build(config))
    specs = specs_from_model(build(config, device="meta"), max_rank=4)
    checked = assert_serves_peft(pm, specs, path)
    assert len(checked) >= 4 * config.num_hidden_layers  # every LoRA layer PEFT made, each located by one node


def test_a_config_no_builder_knows_is_derived_from_the_model_transformers_builds(tmp_path):
    config = tiny_config("olmo2")
    pm, path = all_linear_adapter(tmp_path, build(config))
    specs = specs_from_config(config.to_dict(), max_rank=4)
    assert assert_serves_peft(pm, specs, path)
    assert set(specs["language_model"].targets) == {
        "model.layers.*.self_attn.q_proj+k_proj+v_proj", "model.layers.*.self_attn.o_proj",
        "model.layers.*.mlp.gate_proj+up_proj", "model.layers.*.mlp.down_proj"}
