"""The rules a derived spec follows where the tree and the plan say nothing, each shown on a real model: what
is fused and when, multi-projection linears kept whole, MLA's heads, a stacked expert's orientation (and its
refusal), and targets on some layers holding bytes for those alone, on the host and in the slots."""

from __future__ import annotations

import pytest
import torch
from derived import all_linear_adapter, assert_serves_peft, build, read_all, tiny_config
from torch import nn

from mstar.engine.resources.lora.check import check_adapter_file
from mstar.engine.resources.lora.models import rules
from mstar.engine.resources.lora.models.derived import specs_from_model
from mstar.engine.resources.lora.pool import LoraDevicePool


def derive(family: str, **kw):
    return specs_from_model(build(tiny_config(family), device="meta"), max_rank=4, **kw)


def test_siblings_fuse_by_the_rule_and_an_engine_that_fuses_none_gets_each_alone(tmp_path):
    config = tiny_config("qwen3")
    fused, alone = derive("qwen3"), derive("qwen3", fuse=())
    assert "model.layers.*.self_attn.q_proj+k_proj+v_proj" in fused["language_model"].targets
    names = set(alone["language_model"].targets)
    assert {"model.layers.*.self_attn.k_proj", "model.layers.*.mlp.up_proj"} <= names
    assert not any("+" in n for n in names)
    assert alone["language_model"].targets["model.layers.*.self_attn.k_proj"].heads == (config.num_key_value_heads,)
    pm, path = all_linear_adapter(tmp_path, build(config))
    for specs in (fused, alone):
        for world_size in (1, 4):
            assert len(assert_serves_peft(pm, specs, path, world_size)) == 7 * config.num_hidden_layers


def test_siblings_sharded_apart_by_the_plan_do_not_fuse():
    plan = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise"}
    names = set(derive("llama", tp_plan=plan)["language_model"].targets)
    assert "model.layers.*.self_attn.q_proj+k_proj" not in names
    assert {"model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.v_proj"} <= names


def test_a_multi_projection_linear_stays_whole_and_replicated_unless_the_config_gives_its_slices():
    """Qwen3-Next's in_proj_qkvz (plan: colwise) and Mamba's in_proj hold projections grouped by head in a way
    no field states; Phi-3's qkv_proj and gate_up_proj are exactly (q, k, v) and (gate, up) by the config."""
    plan = {"model.layers.*.linear_attn.in_proj_qkvz": "colwise"}
    qkvz = derive("qwen3_next", tp_plan=plan)["language_model"].targets["model.layers.*.linear_attn.in_proj_qkvz"]
    assert (qkvz.slices, qkvz.parallel) == (1, "replicated")
    mamba = derive("falcon_h1")["language_model"].targets["model.layers.*.mamba.in_proj"]
    assert (mamba.slices, mamba.parallel) == (1, "replicated")
    config = tiny_config("phi3")
    phi = derive("phi3")["language_model"].targets
    head = config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads, config.num_key_value_heads
    assert phi["model.layers.*.self_attn.qkv_proj"].out_features == (q * head, kv * head, kv * head)
    assert phi["model.layers.*.self_attn.qkv_proj"].heads == (q, kv, kv)
    assert phi["model.layers.*.mlp.gate_up_proj"].out_features == (config.intermediate_size,) * 2


def test_mla_projections_shard_by_the_query_heads_under_an_engines_plan(tmp_path):
    config = tiny_config("deepseek_v3")
    plan = {"model.layers.*.self_attn.q_b_proj": "colwise", "model.layers.*.self_attn.kv_b_proj": "colwise",
            "model.layers.*.self_attn.o_proj": "rowwise"}
    specs = derive("deepseek_v3", tp_plan=plan)
    lm = specs["language_model"].targets
    heads = config.num_attention_heads
    assert lm["model.layers.*.self_attn.q_b_proj"].heads == (heads,)
    assert lm["model.layers.*.self_attn.kv_b_proj"].heads == (heads,)
    assert lm["model.layers.*.self_attn.q_a_proj"].parallel == "replicated"  # the latent: the plan is silent
    pm, path = all_linear_adapter(tmp_path, build(config))
    assert assert_serves_peft(pm, specs, path, world_size=4)


@pytest.mark.parametrize(("family", "node", "target", "layers"), [
    ("qwen3_next", "language_model", "model.layers.*.self_attn.q_proj+k_proj+v_proj", (3,)),  # hybrid attention
    ("qwen3_next", "language_model", "model.layers.*.linear_attn.in_proj_qkvz", (0, 1, 2)),
    ("deepseek_v3", "experts", "model.layers.*.mlp.experts.gate_up_proj", (1, 2, 3)),  # a dense first layer
    ("deepseek_v3", "language_model", "model.layers.*.mlp.gate", (1, 2, 3))])
def test_targets_on_some_layers_hold_bytes_for_those_layers_alone(tmp_path, family, node, target, layers):
    config = tiny_config(family)
    specs = derive(family)
    spec = specs[node]
    assert spec.targets[target].layer_ids == layers
    module = target.replace("*", str(layers[-1])).split("+")[0]
    assert spec.locate(module)[:2] == (target, len(layers) - 1)
    absent = next(i for i in range(config.num_hidden_layers) if i not in layers)
    assert spec.locate(target.replace("*", str(absent)).split("+")[0]) is None, f"layer {absent} has none"
    pm, path = all_linear_adapter(tmp_path, build(config))
    held = read_all(specs, path)[node][0]
    assert held.a[target].shape[0] == held.b[target].shape[0] == len(layers)
    pool = LoraDevicePool(spec, 2, dtype=torch.float32)
    assert pool.a[target].shape[:2] == (2, len(layers)) and pool.ranks[target].shape[:2] == (2, len(layers))
    pool.activate(held)
    torch.testing.assert_close(pool.a[target][pool.slot_of("ad")], held.a[target])
    assert assert_serves_peft(pm, specs, path)


class Experts(nn.Module):
    """A stacked experts module of the engine's own, [E, 2I, H] gate and up, [E, H, I] down."""

    def __init__(self, hidden: int, inter: int, transposed: bool | None = None) -> None:
        super().__init__()
        self.num_experts = 4
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.zeros(4, hidden, inter))
        if transposed is not None:
            self.is_transposed = transposed


class Config:
    def __init__(self, hidden: int) -> None:
        self.hidden_size, self.num_experts = hidden, 4

    def to_dict(self) -> dict:
        return vars(self)


class Engine(nn.Module):
    def __init__(self, hidden: int, inter: int, transposed: bool | None = None) -> None:
        super().__init__()
        self.config = Config(hidden)
        self.layers = nn.ModuleList(nn.ModuleDict({"experts": Experts(hidden, inter, transposed)}) for _ in range(2))


def test_a_stacked_experts_orientation_comes_from_its_class_or_its_shape_and_is_refused_when_neither_tells():
    by_shape = specs_from_model(Engine(32, 8), max_rank=4, tp_plan={})["experts"].targets
    assert by_shape["layers.*.experts.gate_up_proj"].experts.layout == "out_in"
    assert (by_shape["layers.*.experts.down_proj"].in_features, by_shape["layers.*.experts.down_proj"].out_features) \
        == (8, (32,) * 4)
    marked = specs_from_model(Engine(16, 8, transposed=False), max_rank=4, tp_plan={})["experts"].targets
    assert marked["layers.*.experts.gate_up_proj"].experts.layout == "out_in"
    with pytest.raises(ValueError, match=r"stacked experts layers\.\*\.experts\.gate_up_proj \[4, 16, 16\]: neither "
                                         r"its class \(Experts, no is_transposed\) nor its shape \(hidden size 16\)"):
        specs_from_model(Engine(16, 8), max_rank=4, tp_plan={})


def test_stacked_factors_that_wrap_some_of_a_classs_parameters_are_refused_by_name(tmp_path):
    """PEFT names a module's wrappers by nesting alone, so with one of two parameters wrapped which one it is
    is not in the keys: refused, never guessed."""
    config = tiny_config("qwen3_moe")
    specs = derive("qwen3_moe")
    _, path = all_linear_adapter(tmp_path, build(config), target_modules=[],
                                 target_parameters=["mlp.experts.down_proj"])
    nodes = list(specs.values())
    with pytest.raises(ValueError, match=r"module model\.layers\.0\.mlp\.experts: no target of language_model, "
                                         r"experts maps it"):
        check_adapter_file(nodes[0], "ad", path, nodes[1:])


def test_peft_all_linear_on_a_transformers_5_moe_adapts_router_and_experts_and_is_served_exactly(tmp_path):
    """PEFT 0.21 turns all-linear on a transformers 5 MoE into target_parameters on the stacked experts and the
    router, and drops the dense MLPs' modules (the dense first layer's, the shared experts'), whose names are
    the experts' old ones."""
    config = tiny_config("deepseek_v3")
    pm, path = all_linear_adapter(tmp_path, build(config))
    checked = assert_serves_peft(pm, derive("deepseek_v3"), path, world_size=2)
    assert {"model.layers.1.mlp.gate", "model.layers.1.mlp.experts.gate_up_proj",
            "model.layers.3.mlp.experts.down_proj", "model.layers.0.self_attn.kv_b_proj"} <= checked
    assert not any(m.startswith("model.layers.0.mlp.") for m in checked)


# The styles transformers 5.24's plans give these classes' stacked experts, as an engine that shards its
# experts by tensor parallelism passes them (5.25 keeps Llama 4's, and moves Qwen3-MoE's to expert parallelism).
EXPERTS_TP = {
    "qwen3_moe": {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                  "model.layers.*.mlp.experts.down_proj": "rowwise"},
    "llama4_text": {"model.layers.*.feed_forward.experts.gate_up_proj": "packed_rowwise",
                    "model.layers.*.feed_forward.experts.down_proj": "colwise"},
}
SHARDED = {"gate_up_proj": "column", "down_proj": "row"}


@pytest.mark.parametrize("family", list(EXPERTS_TP))
def test_a_plans_styles_on_stacked_experts_read_by_how_the_class_stores_them(tmp_path, family):
    """transformers' styles name a weight's dimensions: packed_colwise on Qwen3-MoE's [E, 2I, H] gate_up and
    packed_rowwise on Llama 4's [E, H, 2I] both shard its output; rowwise on [E, H, I] and colwise on [E, I, H]
    down_proj both its input. So sharded, PEFT's stacked factors are served with its deltas."""
    config = tiny_config(family)
    specs = derive(family, tp_plan=EXPERTS_TP[family])
    experts = specs["experts"].targets
    assert {n.rpartition(".")[2]: t.parallel for n, t in experts.items()} == SHARDED
    stacked = sorted({n.rpartition("*.")[2] for n in experts})
    pm, path = all_linear_adapter(tmp_path, build(config), target_modules=[], target_parameters=stacked)
    assert {m.rpartition(".")[2] for m in assert_serves_peft(pm, specs, path, world_size=2)} == set(SHARDED)


@pytest.mark.parametrize("family", ["qwen3_moe", "llama4_text", "mixtral", "deepseek_v3"])
def test_stacked_experts_shard_as_the_models_own_plan_says_and_replicate_where_it_names_none(family):
    """The default plan is the class's base_model_tp_plan. Where it names the stacked experts (every family
    in transformers 5.24, Llama 4 in 5.25) they shard as the class stores them; where it does not (5.25 puts
    them in base_model_ep_plan alone, split by expert, and keeps them whole on every tensor-parallel rank)
    they are replicated, as the model's own ranks hold them."""
    config = tiny_config(family)
    text = config.get_text_config()
    named = {k.rpartition(".")[2] for k in type(text).base_model_tp_plan or {} if ".experts." in k}
    experts = derive(family)["experts"].targets
    got = {n.rpartition(".")[2]: t.parallel for n, t in experts.items()}
    assert got == {leaf: SHARDED[leaf] if leaf in named else "replicated" for leaf in got}


def test_a_moe_config_with_dense_layers_beside_the_experts_is_served_by_the_derived_spec(tmp_path):
    """The Qwen3-MoE builder's targets span every layer; with mlp_only_layers the derived spec serves it."""
    from mstar.engine.resources.lora.models import specs_from_config

    config = tiny_config("qwen3_moe", mlp_only_layers=[0])
    specs = specs_from_config(config.to_dict(), max_rank=4)
    assert specs["experts"].targets["model.layers.*.mlp.experts.gate_up_proj"].layer_ids == (1, 2, 3)
    pm, path = all_linear_adapter(tmp_path, build(config))
    assert assert_serves_peft(pm, specs, path, world_size=2)


def test_a_whole_head_style_shards_by_the_heads_a_slice_is_and_leaves_any_other_whole(tmp_path):
    """transformers 5.25's unit_colwise (MiniCPM5-MoE's k_proj and v_proj) gives each rank whole heads, KV heads
    replicated past their count: the column rule by heads. On a slice whose heads the config does not give (an
    MLP's up_proj) rows would split inside its units, so it stays whole; unit_rowwise, which replicates a rank's
    input heads past their count, too."""
    config = tiny_config("llama")
    model = build(config, device="meta")
    units = {"model.layers.*.self_attn.k_proj": "unit_colwise", "model.layers.*.self_attn.v_proj": "unit_colwise",
             "model.layers.*.mlp.up_proj": "unit_colwise", "model.layers.*.self_attn.o_proj": "unit_rowwise"}
    specs = specs_from_model(model, max_rank=4, tp_plan={**rules.default_plan(model), **units})
    lm = specs["language_model"].targets
    qkv = lm["model.layers.*.self_attn.q_proj+k_proj+v_proj"]
    q, kv = config.num_attention_heads, config.num_key_value_heads
    assert (qkv.parallel, qkv.heads) == ("column", (q, kv, kv))
    assert kv < 4 and qkv.shard(0, 4).rows[1] == qkv.shard(1, 4).rows[1], "a KV head two ranks share"
    assert (lm["model.layers.*.mlp.gate_proj"].parallel, lm["model.layers.*.mlp.up_proj"].parallel,
            lm["model.layers.*.self_attn.o_proj"].parallel) == ("column", "replicated", "replicated")
    pm, path = all_linear_adapter(tmp_path, build(config))
    for world_size in (2, 4):
        assert assert_serves_peft(pm, specs, path, world_size)
