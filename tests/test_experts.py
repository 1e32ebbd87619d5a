"""LoRA on mixture-of-experts experts: every expert's delta from the pool's layout is PEFT's, in every layout
PEFT has written, and what cannot be read for sure is refused by name."""

from __future__ import annotations

import dataclasses
import json
import shutil
from types import SimpleNamespace

import peft
import pytest
import torch
from moe import (
    CONFIGS,
    EXPERTS,
    STACKED,
    assert_deltas,
    build,
    peft_expert_deltas,
    per_expert_adapter,
    pool_expert_deltas,
    read,
    specs,
    stacked_adapter,
)
from safetensors.torch import load_file, save_file
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import LoraAdapterStore, LoraManager, Request, check_adapter_file, specs_from_config


@pytest.mark.parametrize(("family", "config"), [(f, {}) for f in CONFIGS] + [("gpt_oss", {"intermediate_size": 32})])
def test_stacked_experts_give_peft_delta_for_every_expert(tmp_path, family, config):
    """Under transformers 5 (gpt-oss at its own widths too, intermediate_size == hidden_size: a square down_proj)."""
    pm, path = stacked_adapter(tmp_path, family, config=config, alpha_pattern={"down_proj": 6},
                               rank_pattern={"gate_up_proj": 4})
    spec, adapter = read(family, path, **config)
    for layer in range(2):
        assert_deltas(adapter, spec, *peft_expert_deltas(pm, family, layer), layer, f"{family} layer {layer}")


@pytest.mark.parametrize("family", list(CONFIGS))
def test_under_transformers_5_lora_a_is_on_the_input_side(tmp_path, family):
    """What the README says of transformers 5 with PEFT 0.21.2 (H 32, I 24, r 2, 4 experts)."""
    _, path = stacked_adapter(tmp_path, family, target_modules=[])
    layer = "base_model.model.model.layers.0.mlp.experts."
    shapes = {k.removeprefix(layer): list(v.shape) for k, v in load_file(path / "adapter_model.safetensors").items()
              if k.startswith(layer)}
    assert shapes == {"base_layer.lora_A.weight": [8, 32], "base_layer.lora_B.weight": [48, 8],
                      "lora_A.weight": [8, 24], "lora_B.weight": [32, 8]}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_per_expert_modules_give_the_delta_of_peft_converting_them(tmp_path, family):
    """transformers 5 stacks the experts; PEFT converts a per-expert adapter into the stacked one on load."""
    _, path = per_expert_adapter(tmp_path, family)
    converted = peft.PeftModel.from_pretrained(build(family), path).eval()
    spec, adapter = read(family, path)
    for layer in range(2):
        assert_deltas(adapter, spec, *peft_expert_deltas(converted, family, layer), layer, f"{family} layer {layer}")


def test_an_adapter_touching_some_experts_leaves_the_others_zero(tmp_path):
    tensors, path = per_expert_adapter(tmp_path, "qwen3_moe", experts=(0, 2))
    spec, adapter = read("qwen3_moe", path)
    gate_up, down = pool_expert_deltas(adapter, spec, 1)
    for e in range(EXPERTS):
        key = f"base_model.model.model.layers.1.mlp.experts.{e}.down_proj"
        want = 2.0 * tensors[f"{key}.lora_B.weight"] @ tensors[f"{key}.lora_A.weight"] if e in (0, 2) else 0 * down[e]
        torch.testing.assert_close(down[e], want, msg=f"expert {e}")
        assert (gate_up[e].abs().sum() > 0) == (e in (0, 2))


def flipped(path, out, peft_version=None):
    """The same adapter with lora_A on the output side, as PEFT up to 0.18 saved it for [E, out, in] experts
    (it read every stacked parameter as [E, in, out]) and PEFT 0.21.2 for gpt-oss under transformers 4.57."""
    tensors = load_file(path / "adapter_model.safetensors")
    for key in [k for k in tensors if ".mlp.experts" in k and "lora_A" in k]:
        a, b = tensors[key], tensors[key.replace("lora_A", "lora_B")]
        r = a.shape[0] // EXPERTS
        per_in, per_out = a.reshape(EXPERTS, r, -1), b.reshape(b.shape[0], r, EXPERTS).permute(2, 0, 1)
        # each expert's delta B A is A' B'  with A' = (B)^T on the output side and B' = (A)^T on the input side
        tensors[key] = per_out.transpose(1, 2).reshape(EXPERTS * r, -1)
        tensors[key.replace("lora_A", "lora_B")] = per_in.permute(2, 1, 0).reshape(-1, r * EXPERTS)
    out.mkdir()
    save_file(tensors, out / "adapter_model.safetensors")
    return with_config(path, out, peft_version)


def with_config(path, out, peft_version):
    """out's adapter_config.json: path's, saying peft_version (or none)."""
    out.mkdir(exist_ok=True)
    if not (out / "adapter_model.safetensors").exists():
        shutil.copy(path / "adapter_model.safetensors", out)
    config = json.loads((path / "adapter_config.json").read_text())
    config.pop("peft_version", None)
    if peft_version:
        config["peft_version"] = peft_version
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("family", list(CONFIGS))
def test_lora_a_on_the_output_side_is_told_by_the_shapes(tmp_path, family):
    _, path = stacked_adapter(tmp_path, family)
    _, normal = read(family, path)
    _, old = read(family, flipped(path, tmp_path / "old"))
    for t in normal.a:
        assert torch.equal(normal.a[t], old.a[t]) and torch.equal(normal.b[t], old.b[t])


SQUARE = {"moe_intermediate_size": 32}  # down_proj of 32 inputs and 32 outputs; gate_up_proj 32 and 64
VERSIONS = [None, "0.18.2", "0.19.0", "0.21.2"]


@pytest.mark.parametrize(("family", "config"), [("qwen3_moe", SQUARE), ("gpt_oss", {"intermediate_size": 16})])
def test_a_square_expert_takes_the_side_its_file_shows_whatever_peft_version_says(tmp_path, family, config):
    """PEFT puts A on one side for every parameter of an experts class, so one parameter's shapes tell the
    square one's (Qwen3-MoE's down_proj here, gpt-oss's gate_up_proj). The same bytes serve the same deltas
    under one digest whatever peft_version the config says, read in any order through one store (which
    shares a header's read plan)."""
    pm, path = stacked_adapter(tmp_path, family, config=config, target_modules=[])
    want = [peft_expert_deltas(pm, family, layer) for layer in range(2)]
    store = LoraAdapterStore(specs(family, **config)["experts"], pin=False, dtype=torch.float32)
    for side, made in (("in", path), ("out", flipped(path, tmp_path / "out"))):
        digests = set()
        for version in [*VERSIONS, *reversed(VERSIONS)]:
            copy = with_config(made, tmp_path / f"{side}-{version}", version)
            spec, adapter = read(family, copy, store=store, **config)
            digests.add(adapter.digest)
            for layer in range(2):
                assert_deltas(adapter, spec, *want[layer], layer, f"A {side}, peft_version {version}, layer {layer}")
        assert len(digests) == 1


# down_proj alone, of 32 inputs and 32 outputs (gpt-oss's own widths have intermediate_size == hidden_size)
@pytest.mark.parametrize(("family", "config"), [("qwen3_moe", SQUARE), ("gpt_oss", {"intermediate_size": 32})])
def test_a_square_expert_alone_is_refused_whatever_peft_version_says(tmp_path, family, config):
    _, path = stacked_adapter(tmp_path, family, config=config, target_parameters=[STACKED[1]], target_modules=[])
    s = specs(family, **config)
    store = LoraAdapterStore(s["experts"], pin=False, dtype=torch.float32)
    why = (r"mlp\.experts\.down_proj: its stacked factors fit either way round \(32 inputs and 32 outputs per "
           r"expert\) and no other stacked expert in the file shows which: .* nothing in the adapter names the "
           "transformers version")
    for version in reversed(VERSIONS):  # a version once read the square expert its way; now none does
        copy = with_config(path, tmp_path / f"v{version}", version)
        with pytest.raises(ValueError, match=why):
            check_adapter_file(s["language_model"], "sq", copy, [s["experts"]])
        with pytest.raises(ValueError, match=why):
            store.read("sq", copy)


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_shards_recombine_into_the_whole(tmp_path, world_size):
    _, path = stacked_adapter(tmp_path, "qwen3_moe")
    _, per = per_expert_adapter(tmp_path, "qwen3_moe")
    for p in (path, per):
        spec, whole = read("qwen3_moe", p)
        shards = [read("qwen3_moe", p, k, world_size)[1] for k in range(world_size)]
        R = spec.max_rank
        for target in ("experts_gate_up", "experts_down"):
            t = spec.targets[target]
            for s in range(t.slices):
                a, b = whole.a[target][1, s * R : (s + 1) * R], whole.b[target][1]
                width = t.out_features[s]
                want = b[s * width : (s + 1) * width] @ a
                parts = []
                for k, shard in enumerate(shards):
                    r0, r1 = t.b_rows(s, k, world_size)
                    sb, sa = shard.b[target][1], shard.a[target][1, s * R : (s + 1) * R]
                    parts.append(sb[s * (r1 - r0) : (s + 1) * (r1 - r0)] @ sa)
                got = torch.cat(parts, 0) if t.parallel == "column" else torch.cat(parts, 1)
                torch.testing.assert_close(got, want, msg=f"{target} slice {s} at world size {world_size}")


def test_refusals_name_what_does_not_fit(tmp_path):
    s = specs("qwen3_moe", max_expert_rank=1)
    _, path = stacked_adapter(tmp_path, "qwen3_moe", name="two")
    with pytest.raises(ValueError, match=r"rank 2 per expert, over this pool's max_rank 1 for experts"):
        check_adapter_file(s["language_model"], "two", path, [s["experts"]])
    eight = specs("qwen3_moe", num_experts=8)
    with pytest.raises(ValueError, match=r"rank 1, but adapter_config.json gives it r=2"):
        check_adapter_file(eight["language_model"], "two", path, [eight["experts"]])
    wide = specs("qwen3_moe", moe_intermediate_size=48)
    with pytest.raises(ValueError, match=r"do not fit 4 experts of 32 inputs and 96 outputs"):
        check_adapter_file(wide["language_model"], "two", path, [wide["experts"]])
    _, many = per_expert_adapter(tmp_path, "qwen3_moe", name="many", experts=range(6))
    four = specs("qwen3_moe")
    with pytest.raises(ValueError, match=r"mlp.experts.4.down_proj: expert 4 is past the model's 4 experts"):
        check_adapter_file(four["language_model"], "many", many, [four["experts"]])
    llama = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
    with pytest.raises(ValueError, match=r"expert weights, and this model has no experts"):
        check_adapter_file(llama, "many", many)


def test_a_dense_adapter_on_a_moe_model_reads_its_attention(tmp_path):
    _, path = make_adapter(tmp_path, config={**CONFIGS["qwen3_moe"]}, target_modules=["q_proj", "v_proj"])
    s = specs("qwen3_moe")
    check_adapter_file(s["language_model"], "attn", path, [s["experts"]])
    assert set(LoraAdapterStore(s["experts"], pin=False).read("attn", path).a) == set()


ROWS = ["x", None, "y", "x"]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_mixed_batch_routes_tokens_to_experts_under_their_own_adapters(tmp_path, family):
    """Through the device pool and the op, each row gives PEFT's logits with its adapter, and base rows the
    base model's: bit for bit where the batch is the same, to rounding in a mixed one (an expert's matmul
    takes whichever tokens route to it, which other rows' adapters change)."""
    from mstar.engine.resources.lora import LoraDevicePool
    from mstar.engine.resources.lora.tools.hf import TokenSlots, attach

    paths = {n: stacked_adapter(tmp_path, family, name=n, seed=i + 1, r=2 + i)[1] for i, n in enumerate("xy")}
    s = specs(family)
    pools = {}
    for node, spec in s.items():
        store = LoraAdapterStore(spec, pin=False, dtype=torch.float32)
        pools[node] = LoraDevicePool(spec, 2, dtype=torch.float32)
        for n, p in paths.items():
            pools[node].activate(store.read(n, p), keep=list(paths))
    model = build(family)
    slots = TokenSlots()
    assert any(name.endswith("mlp.experts") for name in attach(model, pools, slots))
    slots.rows = torch.tensor([pools["experts"].slot_of(r) if r else -1 for r in ROWS])
    ids = torch.randint(1, 60, (len(ROWS), 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids).logits
        base = build(family)(ids).logits
        slots.rows = torch.full((len(ROWS),), -1)
        assert torch.equal(model(ids).logits, base), "no adapter: the base model, bit for bit"
    for i, r in enumerate(ROWS):
        if r is None:
            torch.testing.assert_close(got[i], base[i], rtol=1e-6, atol=1e-6, msg=f"row {i} is the base model's")
            continue
        with torch.no_grad():
            want = peft.PeftModel.from_pretrained(build(family), paths[r]).eval()(ids[i : i + 1]).logits
        torch.testing.assert_close(got[i : i + 1], want, rtol=1e-4, atol=1e-4, msg=f"row {i} ({r})")
        assert (got[i] - base[i]).abs().max() > 1e-3, "the adapter changes its row"


def test_inspect_shows_experts_a_row_per_layer_and_check_their_bytes(tmp_path, capsys):
    from tiny import write_config

    from mstar.engine.resources.lora.tools.cli import main

    config = write_config(tmp_path, CONFIGS["qwen3_moe"])
    _, path = per_expert_adapter(tmp_path, "qwen3_moe", name="some", experts=(0, 2))
    assert main(["inspect", str(config), str(path), "--max-rank", "8", "--max-expert-rank", "4"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("model.layers.")]
    assert len(rows) == 4, "2 layers x 2 expert targets, not 24 modules"
    assert rows[0][:6] == ["model.layers.0.mlp.experts.*", "experts", "experts_down", "0", "experts", "0,2"]
    assert main(["check", str(config), str(path), "--max-rank", "8", "--max-expert-rank", "4", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    # each layer: gate_up a [8 slices * 4, 32] + b [8 * 24, 4]; down a [4 * 4, 24] + b [4 * 32, 4]; bf16
    assert row["expert_bytes"] == row["host_bytes"] == 2 * 2 * (32 * 32 + 192 * 4 + 16 * 24 + 128 * 4)


def test_a_manager_serves_experts_at_their_own_max_rank(tmp_path):
    """LoraManager.build gives the experts node max_expert_rank, and an admitted request's slot holds
    PEFT's deltas for every expert."""
    pm, path = stacked_adapter(tmp_path, "qwen3_moe")
    manager = LoraManager.build(CONFIGS["qwen3_moe"], max_rank=8, max_expert_rank=4, host_capacity=2, slots=2,
                                dtype=torch.float32, pin=False)
    try:
        assert manager.stores["experts"].spec.max_rank == 4 and manager.stores["language_model"].spec.max_rank == 8
        manager.register("ad", path)
        manager.step([], [Request(0, "ad")])
        manager.wait_for_reads()
        step = manager.step([], [Request(0, "ad")])
        assert step.admitted == [0]
        pool, slot = manager.pools["experts"], step.slot[0]
        in_slot = SimpleNamespace(a={t: pool.a[t][slot] for t in pool.a}, b={t: pool.b[t][slot] for t in pool.b},
                                  scaling=float(pool.scaling[slot]))
        for layer in range(2):
            assert_deltas(in_slot, pool.spec, *peft_expert_deltas(pm, "qwen3_moe", layer), layer, f"layer {layer}")
    finally:
        manager.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_one_node_may_hold_the_experts_beside_plain_targets(tmp_path, family):
    """A spec of a user's own that puts attention and the stacked experts in one node: the experts are oriented
    and laid out as in the experts node, q_proj (no slice, on a target with no experts) as in the language model's,
    byte for byte (o_proj, a target of one slice, locates with none, as the stacked experts do)."""
    _, path = stacked_adapter(tmp_path, family, target_modules=["q_proj", "o_proj"])
    s = specs(family, max_rank=4)
    lm, ex = s["language_model"], s["experts"]
    both = dataclasses.replace(ex, targets={**lm.targets, **ex.targets}, patterns=(*lm.patterns, *ex.patterns),
                               name="both")
    alone = {n: LoraAdapterStore(n_spec, pin=False, dtype=torch.float32).read("ad", path)
             for n, n_spec in (("lm", lm), ("ex", ex))}
    joint = LoraAdapterStore(both, pin=False, dtype=torch.float32).read("ad", path)
    assert set(joint.a) == set(alone["lm"].a) | set(alone["ex"].a) and set(alone["lm"].a) and set(alone["ex"].a)
    for node in alone.values():
        for t in node.a:
            torch.testing.assert_close(joint.a[t], node.a[t], rtol=0, atol=0, msg=t)
            torch.testing.assert_close(joint.b[t] * joint.scaling, node.b[t] * node.scaling, msg=t)


def test_square_per_expert_modules_at_a_rank_of_the_expert_count_are_no_stacked_ones(tmp_path):
    """Each down_proj expert of a square model (inputs as many as outputs) at r = the expert count has factors
    [4, 32] / [32, 4], which would fit the stacked experts either way round: they name their expert, so they are
    read as the per-expert modules they are, not refused as a stacked pair whose side nothing shows."""
    tensors, path = per_expert_adapter(tmp_path, "qwen3_moe", r=EXPERTS, alpha=8, inter=32)
    spec, adapter = read("qwen3_moe", path, moe_intermediate_size=32)
    for layer in range(2):
        _, down = pool_expert_deltas(adapter, spec, layer)
        for e in range(EXPERTS):
            key = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.down_proj"
            want = 2.0 * tensors[f"{key}.lora_B.weight"] @ tensors[f"{key}.lora_A.weight"]
            torch.testing.assert_close(down[e], want, msg=f"layer {layer} expert {e}")
