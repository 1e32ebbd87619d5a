"""Adapters PEFT makes with lookarounds in target_modules and in pattern keys (how configs commonly leave out
a vision tower or a layer) and with bounded repeats in pattern keys: the modules PEFT put LoRA on are the ones
the check takes, and each serves PEFT's own delta, its rank and scaling read from the config as PEFT read it."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from reference import assert_serves_peft, lora_modules
from tiny import build_model, make_adapter, model_config

from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file, specs_from_config
from mstar.engine.resources.lora.checkpoint import open_checkpoint

TARGETS = [
    ("llama", r"^(?!.*mlp).*\.(q_proj|v_proj|down_proj)$"),
    ("llama", r"model\.layers\.(?!0\.)\d+\.self_attn\.(q_proj|v_proj)"),
    ("llama", r".*(?<=self_attn)\.(q_proj|v_proj)"),
    ("llama", r".*(?<!self_attn)\.(?=[gu])\w+_proj"),
    ("qwen2_5_vl", r"^(?!.*visual).*_proj"),
]


def serve(pm, path, arch: str) -> set[str]:
    spec = specs_from_config(model_config(arch), max_rank=8)["language_model"]
    digest = check_adapter_file(spec, "ad", path)
    for adapter in (LoraAdapterStore(spec, pin=False, dtype=torch.float32).read("ad", path, digest),
                    LoraAdapterStore(spec, pin=False, dtype=torch.float32).read("ad", path)):
        served = assert_serves_peft(pm, adapter, spec)
    return served


@pytest.mark.parametrize(("arch", "target"), TARGETS, ids=[t for _, t in TARGETS])
def test_a_lookaround_in_target_modules_takes_the_modules_peft_takes(tmp_path, arch, target):
    pm, path = make_adapter(tmp_path, arch, target_modules=target)
    names = [n for n, _ in build_model(model_config(arch)).named_modules()]
    with open_checkpoint(path) as ckpt:
        rules = ckpt.config.module_rules(names)
    lora = LoraConfig(target_modules=target)
    assert {n for n in names if rules[n].targeted} == {n for n in names if check_target_module_exists(lora, n)}
    assert serve(pm, path, arch) == set(lora_modules(pm)) != set()


def test_lookarounds_in_pattern_keys_give_the_ranks_and_scalings_peft_gave(tmp_path):
    ranks = {r"^(?!.*layers\.1\.).*up_proj": 2, r"(?<=self_attn\.)(?!k)\w_proj": 6}
    alphas = {r"layers\.(?!0)\d\.mlp\.down_proj": 2, r"(?<!mlp\.)o_proj": 24}
    pm, path = make_adapter(tmp_path, r=4, rank_pattern=ranks, alpha_pattern=alphas)
    got = {m: layer.r["default"] for m, layer in lora_modules(pm).items()}
    assert got["model.layers.0.mlp.up_proj"] == 2 and got["model.layers.1.mlp.up_proj"] == 4  # PEFT's, the premise
    assert got["model.layers.0.self_attn.q_proj"] == 6 and got["model.layers.0.self_attn.k_proj"] == 4
    assert serve(pm, path, "llama") == set(lora_modules(pm))


def test_bounded_repeats_in_pattern_keys_serve_the_scalings_peft_gives_layer_100(tmp_path):
    r"""\d{1,2} takes layers 0 to 99, never 100; 10? takes layers 1 and 10, never 100 ("00")."""
    config = model_config("llama", num_hidden_layers=101)
    pm, path = make_adapter(tmp_path, config=config, target_modules=["q_proj"], r=4, lora_alpha=8,
                            rank_pattern={r"layers\.\d{1,2}\.self_attn\.q_proj": 2},
                            alpha_pattern={r"layers\.10?\.self_attn\.q_proj": 3, r"layers\.1\d{2}\..*": 32})
    layers = {m: layer for m, layer in lora_modules(pm).items()}
    q = "model.layers.{}.self_attn.q_proj".format
    assert [layers[q(i)].r["default"] for i in (0, 99, 100)] == [2, 2, 4]  # what PEFT did: the premise
    assert [layers[q(i)].scaling["default"] for i in (1, 10, 11, 100)] == [3 / 2, 3 / 2, 8 / 2, 32 / 4]
    spec = specs_from_config(config, max_rank=8)["language_model"]
    digest = check_adapter_file(spec, "ad", path)
    adapter = LoraAdapterStore(spec, pin=False, dtype=torch.float32).read("ad", path, digest)
    assert assert_serves_peft(pm, adapter, spec) == set(layers)
