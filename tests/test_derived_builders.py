"""Every architecture a hand-written builder covers: the spec derived from the model serves the same adapters
with the same deltas, its targets alike (widths, heads where both shard by them, experts' layout)."""

from __future__ import annotations

import pytest
import torch
from derived import all_linear_adapter, assert_serves_peft, build, peft_deltas, read_all, slot_delta, tiny_config, whole

from mstar.engine.resources.lora.models import BUILDERS, specs_from_config
from mstar.engine.resources.lora.models.derived import specs_from_model

TRANSFORMERS_BUILT = sorted(set(BUILDERS) - {"wan", "flux"})  # the diffusers ones are issue 26's


def adapter(tmp_path, family, model):
    """PEFT's all-linear (with the stacked experts and the router for Qwen3-MoE and Mixtral); gpt-oss's
    experts and router by target_parameters, which all-linear leaves out."""
    if family == "gpt_oss":
        return all_linear_adapter(tmp_path, model, target_parameters=[
            "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.router.weight"])
    return all_linear_adapter(tmp_path, model)


@pytest.mark.parametrize("family", TRANSFORMERS_BUILT)
def test_the_derived_spec_serves_a_builders_adapters_with_its_deltas(tmp_path, family):
    config = tiny_config(family)
    pm, path = adapter(tmp_path, family, build(config))
    hand = specs_from_config(config.to_dict(), max_rank=4)
    derived = specs_from_model(build(config, device="meta"), max_rank=4)
    assert assert_serves_peft(pm, hand, path) == assert_serves_peft(pm, derived, path)
    held = {which: read_all(specs, path) for which, specs in (("hand", hand), ("derived", derived))}
    for module in peft_deltas(pm):
        got = {}
        for which, specs in (("hand", hand), ("derived", derived)):
            node = next(n for n, s in specs.items() if s.locate(module) is not None)
            spec, ranks = specs[node], held[which][node]
            target, _, s = spec.locate(module)
            got[which] = (spec.targets[target], s, slot_delta(spec, *whole(spec, ranks, target), ranks[0].scaling,
                                                              module))
        (th, sh, dh), (td, sd, dd) = got["hand"], got["derived"]
        assert torch.equal(dh, dd), f"{module}: the two specs serve different deltas"
        assert (th.layers, th.in_features, th.out_features, th.kernel, sh) == \
            (td.layers, td.in_features, td.out_features, td.kernel, sd), module
        if th.experts is not None or td.experts is not None:  # interleaving says nothing of one slice an expert
            per = th.slices // th.experts.count
            assert th.experts[:2] == td.experts[:2] and (per == 1 or th.experts == td.experts), module
        if th.parallel == td.parallel == "column":
            assert th.heads == td.heads, f"{module}: heads {th.heads} by hand, {td.heads} derived"


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen2_vl", "phi3"])
def test_a_plan_shards_the_derived_targets_as_it_says_kv_heads_replicating_past_their_count(family):
    config = tiny_config(family)
    text = getattr(config, "text_config", config)
    lm = specs_from_model(build(config, device="meta"), max_rank=4)["language_model"]
    qkv = next(t for n, t in lm.targets.items() if n.endswith(("q_proj+k_proj+v_proj", "qkv_proj")))
    q, kv = text.num_attention_heads, text.num_key_value_heads
    assert (qkv.parallel, qkv.heads) == ("column", (q, kv, kv))
    assert kv < 4 and qkv.shard(0, 4).rows[1] == qkv.shard(1, 4).rows[1], "a KV head two ranks share"
    assert {t.parallel for n, t in lm.targets.items() if n.endswith(("o_proj", "down_proj"))} == {"row"}
    assert specs_from_model(build(config, device="meta"), max_rank=4, tp_plan={})["language_model"].targets[
        next(n for n in lm.targets if n.endswith("o_proj"))].parallel == "replicated", "the engine's plan rules"
