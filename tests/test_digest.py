"""adapter_digest: stable under re-saving, changed by any served byte or scaling."""

from __future__ import annotations

import json

import safetensors.torch
from tiny import make_adapter, model_config

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.store import check_adapter_file


def spec():
    return specs_from_config(model_config("llama"), max_rank=8)["language_model"]


def resave(path, change=lambda tensors: None, order=sorted):
    file = path / "adapter_model.safetensors"
    tensors = safetensors.torch.load_file(file)
    change(tensors)
    safetensors.torch.save_file({k: tensors[k] for k in order(tensors)}, file)


def test_same_digest_when_resaved_in_another_tensor_order(tmp_path):
    _, path = make_adapter(tmp_path)
    before = check_adapter_file(spec(), "ad", path)
    resave(path, order=lambda t: sorted(t, reverse=True))
    assert check_adapter_file(spec(), "ad", path) == before


def test_digest_changes_with_one_weight_byte(tmp_path):
    _, path = make_adapter(tmp_path)
    before = check_adapter_file(spec(), "ad", path)

    def flip(tensors):
        t = tensors["base_model.model.model.layers.2.mlp.down_proj.lora_B.weight"]
        t.view(-1).view(dtype=__import__("torch").int32)[7] ^= 1  # the lowest mantissa bit of one weight

    resave(path, flip)
    assert check_adapter_file(spec(), "ad", path) != before


def test_digest_changes_with_lora_alpha(tmp_path):
    _, path = make_adapter(tmp_path)
    before = check_adapter_file(spec(), "ad", path)
    cfg = path / "adapter_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "lora_alpha": 9}))
    assert check_adapter_file(spec(), "ad", path) != before


def test_digest_changes_with_an_alpha_pattern_for_one_module(tmp_path):
    _, path = make_adapter(tmp_path)
    before = check_adapter_file(spec(), "ad", path)
    cfg = path / "adapter_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "alpha_pattern": {"layers.1.self_attn.q_proj": 2}}))
    assert check_adapter_file(spec(), "ad", path) != before


def test_digest_is_the_same_for_every_node(tmp_path):
    from reference import VISION_MODULES
    from tiny import LM_TARGETS

    _, path = make_adapter(tmp_path, "qwen2_vl", target_modules=LM_TARGETS + VISION_MODULES)
    specs = specs_from_config(model_config("qwen2_vl"), max_rank=8)
    lm, vision = specs["language_model"], specs["vision_tower"]
    assert check_adapter_file(lm, "ad", path, [vision]) == check_adapter_file(vision, "ad", path, [lm])
