"""Tensor-parallel shards: the rule as a table, and shards that recombine into the unsharded delta."""

from __future__ import annotations

import pytest
import torch
from reference import VISION_MODULES, lora_modules, module_input, slot_delta
from tiny import LM_TARGETS, make_adapter, model_config

from mstar.engine.resources.lora.layout import TargetLayout
from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.spec import LoraTarget, shard_units
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file

# (units, unit rows, rank, world_size) -> rows [start, stop)
SHARD_TABLE = [
    ((32, 128, 0, 4), (0, 1024)),
    ((32, 128, 3, 4), (3072, 4096)),
    ((8, 128, 1, 2), (512, 1024)),
    ((8, 128, 5, 8), (640, 768)),
    ((2, 128, 0, 8), (0, 128)),  # 2 KV heads on 8 ranks: ranks 0-3 share head 0
    ((2, 128, 3, 8), (0, 128)),
    ((2, 128, 4, 8), (128, 256)),
    ((2, 128, 7, 8), (128, 256)),
    ((1, 64, 2, 4), (0, 64)),
    ((14336, 1, 1, 8), (1792, 3584)),  # an MLP slice shards by rows
]


@pytest.mark.parametrize(("args", "rows"), SHARD_TABLE)
def test_shard_rule_table(args, rows):
    assert shard_units(*args) == rows


def test_indivisible_sizes_are_spec_errors():
    with pytest.raises(ValueError, match="do not split over 4 ranks"):
        shard_units(6, 8, 0, 4)
    with pytest.raises(ValueError, match="cannot be replicated evenly over 6 ranks"):
        shard_units(4, 8, 0, 6)
    with pytest.raises(ValueError, match=r"target 'qkv_proj': slice 0 \(heads\): 4 units do not split over 3"):
        spec = specs_from_config(model_config("llama", num_attention_heads=4), max_rank=8)["language_model"]
        LoraAdapterStore(spec, rank=0, world_size=3, pin=False)


def test_row_target_splits_input_column_target_keeps_it():
    row = LoraTarget(2, 96, (64,), "row")
    col = LoraTarget(2, 64, (64, 16, 16), "column", (8, 2, 2))
    r, c = (TargetLayout(t, 16, t.shard(1, 4), torch.bfloat16) for t in (row, col))
    assert row.a_columns(1, 4) == (24, 48) and r.a_shape == (2, 16, 24) and r.b_shape == (2, 64, 16)
    assert col.a_columns(1, 4) == (0, 64) and c.a_shape == (2, 48, 64) and c.b_shape == (2, 32, 16)
    # q: 8 heads of 8 rows, rank 1 takes heads 2-3; k and v: 2 heads on 4 ranks, ranks 0-1 share head 0
    assert c.shard.rows == ((16, 32), (0, 8), (0, 8))
    assert [c.b_rows(s) for s in range(3)] == [slice(0, 16), slice(16, 24), slice(24, 32)], "packed in slice order"


GQA = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8}


@pytest.fixture(scope="module")
def vl_adapter(tmp_path_factory):
    config = model_config("qwen2_vl", **GQA)
    pm, path = make_adapter(tmp_path_factory.mktemp("vl"), "qwen2_vl", config=config,
                            target_modules=LM_TARGETS + VISION_MODULES, alpha_pattern={"o_proj": 3})
    return config, pm, path


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_shards_recombine_into_the_unsharded_delta(vl_adapter, world_size):
    config, pm, path = vl_adapter
    g = torch.Generator().manual_seed(world_size)
    specs = list(specs_from_config(config, max_rank=8).values())
    digest = check_adapter_file(specs[0], "ad", path, specs[1:])
    for spec in specs:
        whole = LoraAdapterStore(spec, pin=False, dtype=torch.float32).read("ad", path, digest)
        shards = [LoraAdapterStore(spec, k, world_size, pin=False, dtype=torch.float32).read("ad", path, digest)
                  for k in range(world_size)]
        assert {s.digest for s in shards} == {whole.digest}, "every rank and world size agrees on the digest"
        for module, layer in lora_modules(pm).items():
            loc = spec.locate(module)
            if loc is None:
                continue
            t = spec.targets[loc[0]]
            x = module_input(layer, 3, g).flatten(1)
            want = slot_delta(whole.a, whole.b, whole.scaling, spec, module, x)
            if t.parallel == "row":  # each rank sees its chunk of the input; partial outputs sum
                got = sum(slot_delta(s.a, s.b, s.scaling, spec, module, x[:, slice(*t.a_columns(k, world_size))],
                                     world_size) for k, s in enumerate(shards))
            elif t.parallel == "replicated":
                got = slot_delta(shards[-1].a, shards[-1].b, shards[-1].scaling, spec, module, x, world_size)
            else:  # each rank computes its rows of each slice; replicated rows must agree
                got = torch.full_like(want, float("nan"))
                slices = range(t.slices) if loc[2] is None else (loc[2],)
                for k, s in enumerate(shards):
                    part = slot_delta(s.a, s.b, s.scaling, spec, module, x, world_size)
                    at = 0
                    base = 0
                    for sl in slices:
                        r0, r1 = t.b_rows(sl, k, world_size)
                        rows = got[:, base + r0 : base + r1]
                        mine = part[:, at : at + r1 - r0]
                        if not rows.isnan().all():
                            torch.testing.assert_close(rows, mine)
                        rows.copy_(mine)
                        at += r1 - r0
                        base += t.out_features[sl]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{module} at world size {world_size}")


def test_each_shard_is_its_part_of_the_whole(vl_adapter):
    config, _, path = vl_adapter
    spec = specs_from_config(config, max_rank=8)["language_model"]
    whole = LoraAdapterStore(spec, pin=False, dtype=torch.float32).read("ad", path)
    n = 8
    for k in range(n):
        s = LoraAdapterStore(spec, k, n, pin=False, dtype=torch.float32).read("ad", path)
        # qkv_proj: A whole; q rows by heads (1 of 8 per rank), k and v: 2 heads, ranks 4k..4k+3 share one
        assert torch.equal(s.a["qkv_proj"], whole.a["qkv_proj"])
        q, kv = slice(8 * k, 8 * k + 8), slice(8 * (k // 4), 8 * (k // 4) + 8)
        b = whole.b["qkv_proj"]
        assert torch.equal(s.b["qkv_proj"], torch.cat([b[:, q], b[:, 64:80][:, kv], b[:, 80:96][:, kv]], 1))
        # o_proj and down_proj: A's input columns in 8 chunks, B whole
        assert torch.equal(s.a["o_proj"], whole.a["o_proj"][:, :, 8 * k : 8 * k + 8])
        assert torch.equal(s.a["down_proj"], whole.a["down_proj"][:, :, 12 * k : 12 * k + 12])
        assert torch.equal(s.b["down_proj"], whole.b["down_proj"])
        # gate_up_proj: each of gate and up by rows, 12 of 96 each
        g = whole.b["gate_up_proj"]
        gate, up = g[:, 12 * k : 12 * k + 12], g[:, 96 + 12 * k : 108 + 12 * k]
        assert torch.equal(s.b["gate_up_proj"], torch.cat([gate, up], 1))
