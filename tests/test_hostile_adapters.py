"""Arbitrary keys and shapes, as a hostile or broken trainer might write them: every answer is a
digest, an AdapterInfo or a ValueError naming the adapter, never another exception."""

from __future__ import annotations

import json

import torch
from diffusion import WAN
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from tiny import model_config

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.spec import AdapterInfo
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file, inspect_keys

LM = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
DIT = specs_from_config(WAN, max_rank=8)["transformer"]

modules = st.sampled_from([
    "base_model.model.model.layers.0.self_attn.q_proj", "base_model.model.model.layers.1.mlp.down_proj",
    "base_model.model.model.layers.9.mlp.up_proj", "base_model.model.lm_head", "base_model.model.model.norm",
    "diffusion_model.blocks.0.self_attn.q", "lora_unet_blocks_1_ffn_2", "lora_unet_blocks_0_cross_attn_k_img",
    "transformer.blocks.0.attn2.to_v", "transformer.patch_embedding", "lora_unet_nonsense_x", "x",
])
suffixes = st.sampled_from([".lora_A.weight", ".lora_B.weight", ".lora_down.weight", ".lora_up.weight", ".alpha",
                            ".dora_scale", ".hada_w1_a", ".diff", ".weight", ".bias", ".lora_B.bias", ""])
shapes = st.lists(st.integers(0, 70), max_size=5).map(tuple)
items = st.lists(st.tuples(st.builds(str.__add__, modules, suffixes), shapes), max_size=12,
                 unique_by=lambda kv: kv[0])


@settings(max_examples=300, deadline=None)
@given(items)
def test_inspect_keys_answers_any_key_list(pairs):
    for spec in (LM, DIT):
        assert isinstance(inspect_keys(spec, pairs), AdapterInfo)


small = st.lists(st.integers(1, 20), min_size=0, max_size=3).map(tuple)
tensors = st.lists(st.tuples(st.builds(str.__add__, modules, suffixes), small,
                             st.sampled_from([torch.float32, torch.bfloat16, torch.int8])),
                   min_size=1, max_size=8, unique_by=lambda t: t[0])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensors, st.booleans())
@example([("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", (), torch.float32),  # scalars, under
          ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", (), torch.float32)], True)  # a config
def test_check_and_read_answer_any_small_file(tmp_path, entries, with_config):
    path = tmp_path / "ad"
    path.mkdir(exist_ok=True)
    save_file({k: torch.ones(shape, dtype=dtype) for k, shape, dtype in entries}, path / "adapter_model.safetensors")
    config = path / "adapter_config.json"
    if with_config:
        config.write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    elif config.exists():
        config.unlink()
    for spec in (LM, DIT):
        try:
            digest = check_adapter_file(spec, "hostile", path / "adapter_model.safetensors")
        except ValueError as e:
            assert "adapter 'hostile'" in str(e)
            continue
        adapter = LoraAdapterStore(spec, pin=False).read("hostile", path / "adapter_model.safetensors", digest)
        assert adapter.digest == digest


plausible = st.fixed_dictionaries({
    "r": st.integers(1, 10),
    "a_dtype": st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int8]),
    "b_dtype": st.sampled_from([torch.float32, torch.bfloat16]),
    "alpha": st.one_of(st.none(), st.sampled_from([0.0, -1.0, 2.0, float("nan"), float("inf")])),
    "alpha_shape": st.sampled_from([(), (1,), (2,)]),
    "layout": st.sampled_from(["native", "kohya", "diffusers"]),
    "b_rows": st.sampled_from([16, 15]),
})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plausible)
def test_near_valid_wan_adapters_are_served_exactly_or_refused(tmp_path, p):
    """Nearly valid files: a rank over max_rank, mixed dtypes, odd alphas, a wrong shape."""
    prefix = {"native": "diffusion_model.blocks.0.self_attn.q", "kohya": "lora_unet_blocks_0_self_attn_q",
              "diffusers": "transformer.blocks.0.attn1.to_q"}[p["layout"]]
    down, up = (".lora_A.weight", ".lora_B.weight") if p["layout"] != "kohya" else (".lora_down.weight",
                                                                                      ".lora_up.weight")
    tensors = {prefix + down: torch.ones(p["r"], 16, dtype=p["a_dtype"]),
               prefix + up: torch.ones(p["b_rows"], p["r"], dtype=p["b_dtype"])}
    if p["alpha"] is not None:
        tensors[prefix + ".alpha"] = torch.full(p["alpha_shape"], p["alpha"])
    file = tmp_path / "near.safetensors"
    save_file(tensors, file)
    valid = (p["r"] <= 8 and p["a_dtype"] == p["b_dtype"] and p["b_rows"] == 16
             and (p["alpha"] is None or (p["alpha_shape"] != (2,) and p["alpha"] >= 0 and p["alpha"] != float("inf"))))
    try:
        digest = check_adapter_file(DIT, "near", file)
    except ValueError as e:
        assert not valid, f"refused a valid adapter: {e}"
        assert "adapter 'near'" in str(e)
        return
    assert valid, "served an adapter it should refuse"
    adapter = LoraAdapterStore(DIT, pin=False, dtype=torch.float32).read("near", file, digest)
    alpha = p["r"] if not p["alpha"] else p["alpha"]
    assert adapter.scaling == alpha / p["r"]
    assert adapter.a["self_qkv"][0, : p["r"]].eq(1).all() and adapter.a["self_qkv"][0, p["r"] :].eq(0).all()
