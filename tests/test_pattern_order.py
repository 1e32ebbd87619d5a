"""rank_pattern and alpha_pattern keys that overlap: the first key PEFT tries wins, as in PEFT's own delta.

PEFT saves adapter_config.json with its keys sorted, and tries them in the order it holds them; the keys here
are given sorted, so the model PEFT built and the file it saved agree on which key is first."""

from __future__ import annotations

import json

import pytest
import torch
from reference import assert_serves_peft, lora_modules
from tiny import make_adapter, model_config

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file

# Each name a later key also matches: layer 1's q_proj (a plain name, then a suffix of it), layer 2's up_proj
# (a regex, then a plain suffix); layer 2's v_proj and every down_proj for alphas.
RANKS = {"layers.1.self_attn.q_proj": 6, r"layers\.2\.mlp\.(up|gate)_proj": 8, "q_proj": 2, "up_proj": 3}
ALPHAS = {"down_proj": 5, "layers.0.mlp.down_proj": 20, r"layers\.2\..*_proj": 3, "v_proj": 7}
WANT_RANK = {"layers.0.self_attn.q_proj": 2, "layers.1.self_attn.q_proj": 6, "layers.2.mlp.up_proj": 8,
             "layers.1.mlp.up_proj": 3, "layers.2.mlp.gate_proj": 8, "layers.0.mlp.gate_proj": 4}


@pytest.fixture(scope="module")
def overlapping(tmp_path_factory):
    assert list(RANKS) == sorted(RANKS) and list(ALPHAS) == sorted(ALPHAS), "PEFT's own order"
    pm, path = make_adapter(tmp_path_factory.mktemp("patterns"), r=4, lora_alpha=8, rank_pattern=RANKS,
                            alpha_pattern=ALPHAS)
    saved = json.loads((path / "adapter_config.json").read_text())
    assert list(saved["rank_pattern"]) == list(RANKS) and list(saved["alpha_pattern"]) == list(ALPHAS)
    return pm, path


def test_the_first_matching_key_gives_the_rank_peft_gave(overlapping):
    pm, _ = overlapping
    ranks = {m: layer.r["default"] for m, layer in lora_modules(pm).items()}
    for module, r in WANT_RANK.items():  # what PEFT itself did, the premise of the next test
        assert ranks[f"model.{module}"] == r, module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-store", "bf16-store"])
def test_overlapping_patterns_serve_peft_delta(overlapping, dtype):
    pm, path = overlapping
    spec = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
    digest = check_adapter_file(spec, "ad", path)
    for adapter in LoraAdapterStore(spec, pin=False, dtype=dtype).read("ad", path, digest), \
            LoraAdapterStore(spec, pin=False, dtype=dtype).read("ad", path):
        checked = assert_serves_peft(pm, adapter, spec, tol=1e-5 if dtype == torch.float32 else 2e-2)
        assert checked == set(lora_modules(pm))


def test_a_regex_key_matches_a_whole_dotted_part_of_the_name(tmp_path):
    """(up|down)_proj is phi3's down_proj, never its gate_up_proj: PEFT's rule wants a dot (or the start)
    before the key."""
    pm, path = make_adapter(tmp_path, "phi3", alpha_pattern={"(up|down)_proj": 3})
    scalings = {m: layer.scaling["default"] for m, layer in lora_modules(pm).items()}
    assert scalings["model.layers.0.mlp.down_proj"] == 3 / 4 and scalings["model.layers.0.mlp.gate_up_proj"] == 2
    spec = specs_from_config(model_config("phi3"), max_rank=8)["language_model"]
    adapter = LoraAdapterStore(spec, pin=False, dtype=torch.float32).read("ad", path)
    assert assert_serves_peft(pm, adapter, spec) == set(lora_modules(pm))
