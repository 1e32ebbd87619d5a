"""A file holding weights its config leaves out (layers outside layers_to_transform, modules target_modules does
not name): PEFT, loading it, puts no LoRA there and drops those weights without a word, so the check refuses
them, naming each such module."""

from __future__ import annotations

import json
import re

import pytest
import torch
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from reference import assert_serves_peft
from tiny import LM_TARGETS, make_adapter, model_config

from mstar.engine.resources.lora.adapter_config import parse_config
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


NAMES = [f"model.layers.{i}.{PARTS[m]}.{m}" for i in (0, 1, 2, 10) for m in ("q_proj", "v_proj", "down_proj")] + [
    "model.layers.1.mlp.experts.3.gate_proj", "model.h.2.attn.q_proj", "transformer.h.1.v_proj", "q_proj",
    "model.q_proj", "a.1.b.2.q_proj", "model.decoder.layers.1.self_attn.q_proj", "model.layers.x1.q_proj",
    "model.layers.2.q_proj.1.v_proj"]


@pytest.mark.parametrize("lora", [
    dict(target_modules=["model.layers.2.self_attn.q_proj", "v_proj"], layers_to_transform=[0]),
    dict(target_modules=["q_proj", "v_proj"], layers_to_transform=[]),
    dict(target_modules=["q_proj", "v_proj", "down_proj", "gate_proj"], layers_to_transform=1),
    dict(target_modules=["q_proj", "v_proj"], layers_to_transform=[1, 2], layers_pattern="h"),
    dict(target_modules=["q_proj", "v_proj"], layers_to_transform=[1], layers_pattern=["decoder.layers", "layers"]),
], ids=["a-name-whole", "empty", "an-int", "a-pattern", "patterns-in-order"])
def test_which_modules_a_config_takes_is_peft_own_rule(lora):
    """layers_to_transform restricts only modules target_modules takes by a dotted suffix, at the layer index
    PEFT reads (the first after two words, or after a layers_pattern): name by name against PEFT's own rule."""
    raw = LoraConfig(**lora).to_dict()
    config = parse_config(json.loads(json.dumps(raw, default=list)))
    for name in NAMES:
        want = bool(check_target_module_exists(LoraConfig(**lora), name))
        assert (config.targets(name) and config.transforms_layer(name)) == want, name


@pytest.mark.parametrize("lora", [
    dict(target_modules=["model.layers.2.self_attn.q_proj", "v_proj"], layers_to_transform=[0]),
    dict(target_modules=["q_proj", "v_proj"], layers_to_transform=[]),
    dict(target_modules=["q_proj", "down_proj"], layers_to_transform=[1, 2], layers_pattern="layers"),
], ids=["a-name-whole", "empty", "a-pattern"])
def test_an_adapter_peft_makes_with_layers_to_transform_serves_peft_delta(tmp_path, lora):
    pm, path = make_adapter(tmp_path, **lora)
    digest = check_adapter_file(SPEC, "ad", path)
    adapter = LoraAdapterStore(SPEC, pin=False, dtype=torch.float32).read("ad", path, digest)
    assert assert_serves_peft(pm, adapter, SPEC)


def test_layers_to_transform_with_a_target_modules_regex_is_refused_as_peft_refuses_it(tmp_path):
    _, path = make_adapter(tmp_path, target_modules=r".*\.q_proj")
    config = path / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "layers_to_transform": [0]}))
    with pytest.raises(ValueError, match=r"adapter 'ad' \(.*adapter_config\.json\): layers_to_transform with a "
                                         "target_modules regex"):
        check_adapter_file(SPEC, "ad", path)


PATTERN_NAMES = [*NAMES, "model.layers.0.mlp.layers.1.q_proj", "model.h.1.blocks.0.q_proj", "layers.3.q_proj",
                 "model.layers.٣.q_proj", "model.(layers).1.q_proj", "x.h|x.2.q_proj", "model.layers.2.h.1.q_proj"]


@pytest.mark.parametrize("pattern", ["layers", "h", "h|x", r"layers\.", "^layers", r"\Alayers", "layers$", r"layers\Z",
                                     "(?#()layers", r"\(layers\)", "[|]", "(h|x)", "", ".", "model.layers", r"\d"])
def test_a_layers_pattern_takes_the_layer_index_peft_does(pattern):
    """PEFT pastes layers_pattern into its own regex; so is it here, for patterns that neither repeat nor
    alternate: anchors, comments, a | a class collapses, Unicode digits all read as in PEFT."""
    lora = dict(target_modules=["q_proj"], layers_to_transform=[1, 2], layers_pattern=[pattern])
    config = parse_config({"peft_type": "LORA", **lora})
    for name in PATTERN_NAMES:
        want = bool(check_target_module_exists(LoraConfig(**lora), name))
        assert (config.targets(name) and config.transforms_layer(name)) == want, name


@pytest.mark.parametrize("pattern", [".*layers", "[\\w.]+", ".+", "layers|h", "(ab|b)", "x{2}"])
def test_a_layers_pattern_that_repeats_or_alternates_is_refused(tmp_path, pattern):
    """PEFT's layer regex around such a pattern backtracks, and which index it finds follows re's own order."""
    _, path = make_adapter(tmp_path, target_modules=["q_proj"])
    config = path / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "layers_to_transform": [0],
                                  "layers_pattern": pattern}))
    with pytest.raises(ValueError, match=r"adapter 'ad' \(.*adapter_config\.json\): layers_pattern .* cannot be "
                                         "matched: it repeats or alternates"):
        check_adapter_file(SPEC, "ad", path)


@pytest.mark.parametrize("fields", [
    {"target_modules": ".*q_proj", "layers_pattern": ""},
    {"target_modules": ".*q_proj", "layers_to_transform": []},
    {"target_modules": ["q_proj"], "layers_pattern": "layers"},
])
def test_a_config_peft_refuses_to_load_is_refused(fields):
    with pytest.raises(ValueError):
        LoraConfig(**fields)
    with pytest.raises(ValueError, match="a config PEFT refuses to load"):
        parse_config({"peft_type": "LORA", **fields})
