"""A file holding weights its config leaves out (layers outside layers_to_transform, modules target_modules does
not name): PEFT, loading it, puts no LoRA there and drops those weights without a word, so the check refuses
them, naming each such module."""

from __future__ import annotations

import json
import re

import pytest
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from tiny import LM_TARGETS, make_adapter, model_config

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file, inspect_adapter

SPEC = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
PARTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@pytest.fixture
def every_layer_but_config_says_2(tmp_path):
    _, path = make_adapter(tmp_path)
    config = path / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "layers_to_transform": [2]}))
    return path


def test_modules_outside_layers_to_transform_are_misfits_and_the_rest_are_not(every_layer_but_config_says_2):
    info = inspect_adapter(SPEC, every_layer_but_config_says_2)
    want = {f"model.layers.{layer}.{PARTS[m]}.{m}" for layer in (0, 1) for m in LM_TARGETS}
    assert set(info.misfits) == want
    assert all(why == f"layer {m.split('.')[2]} is outside layers_to_transform [2]" for m, why in info.misfits.items())


def test_the_check_and_a_read_refuse_it_naming_adapter_file_and_layers(every_layer_but_config_says_2):
    path = every_layer_but_config_says_2
    where = re.escape(f"adapter 'ad' ({path / 'adapter_model.safetensors'}):\n")
    lines = "".join(rf"  - module model\.layers\.{layer}\.mlp\.down_proj: layer {layer} is outside layers_to_transform "
                    r"\[2\] \(and 6 more modules alike\)" + ("\n" if layer == 0 else "") for layer in (0, 1))
    with pytest.raises(ValueError, match=f"^{where}{lines}$"):
        check_adapter_file(SPEC, "ad", path)
    with pytest.raises(ValueError, match=f"^{where}{lines}$"):
        LoraAdapterStore(SPEC, pin=False).read("ad", path)


def test_a_target_module_name_takes_modules_of_that_name_not_names_ending_in_it(tmp_path):
    """phi3's fused gate_up_proj ends in up_proj, but target_modules ["up_proj"] is not it, in PEFT's rule."""
    _, path = make_adapter(tmp_path, "phi3", target_modules=["qkv_proj", "gate_up_proj"])
    config = path / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "target_modules": ["qkv_proj", "up_proj"]}))
    module = "model.layers.0.mlp.gate_up_proj"
    assert not check_target_module_exists(LoraConfig(target_modules=["qkv_proj", "up_proj"]), module)
    spec = specs_from_config(model_config("phi3"), max_rank=8)["language_model"]
    with pytest.raises(ValueError, match=rf"module {re.escape(module)}: adapter_config\.json's target_modules / "
                                         r"exclude_modules leave it out.* \(and 2 more modules alike\)$"):
        check_adapter_file(spec, "ad", path)
