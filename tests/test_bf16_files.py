"""Adapters saved in bfloat16 (and float16), as trainers in half precision save them: read into a float32 store
they serve PEFT's delta exactly, and into a bfloat16 store each module's own scaling is folded in float32 and
cast once."""

from __future__ import annotations

import pytest
import torch
from reference import assert_serves_peft, lora_modules
from tiny import SAFETENSORS_DTYPES, make_adapter, model_config, saved_dtypes

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file

# Every way a B is folded: down_proj at max_rank (read straight into the slot, folded there), o_proj with one
# ratio for the whole target (folded at once), k_proj and v_proj below max_rank in one target with q_proj (folded
# piece by piece), layer 1's down_proj with a ratio of its own. Keys sorted, as PEFT saves them.
PATTERNS = {"rank_pattern": {"down_proj": 8, "k_proj": 2},
            "alpha_pattern": {"layers.1.mlp.down_proj": 4, "o_proj": 3, "v_proj": 5}}
SHARDS = [(0, 1), (1, 2)]


def half_adapter(root, dtype):
    pm, path = make_adapter(root, dtype=dtype, **PATTERNS)
    assert saved_dtypes(path) == {SAFETENSORS_DTYPES[dtype]}
    spec = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
    return pm.float(), path, spec, check_adapter_file(spec, "ad", path)  # half values are exact in float32


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16-file", "f16-file"])
def half_file(request, tmp_path_factory):
    return half_adapter(tmp_path_factory.mktemp("half"), request.param)


@pytest.fixture(scope="module")
def bf16_adapter(tmp_path_factory):
    return half_adapter(tmp_path_factory.mktemp("bf16"), torch.bfloat16)


@pytest.mark.parametrize("verified", [False, True], ids=["shard-only", "with-digest"])
def test_a_half_precision_file_read_into_a_float32_store_serves_peft_delta(half_file, verified):
    pm, path, spec, digest = half_file
    adapter = LoraAdapterStore(spec, pin=False, dtype=torch.float32).read("ad", path, digest if verified else None)
    assert assert_serves_peft(pm, adapter, spec) == set(lora_modules(pm))


@pytest.mark.parametrize("verified", [False, True], ids=["shard-only", "with-digest"])
@pytest.mark.parametrize(("rank", "world_size"), SHARDS, ids=["whole", "rank-1-of-2"])
def test_a_half_precision_file_read_into_a_bf16_store_folds_in_float32_and_casts_once(half_file, verified, rank,
                                                                                      world_size):
    pm, path, spec, digest = half_file
    digest = digest if verified else None
    exact = LoraAdapterStore(spec, rank, world_size, pin=False, dtype=torch.float32).read("ad", path, digest)
    cast = LoraAdapterStore(spec, rank, world_size, pin=False, dtype=torch.bfloat16).read("ad", path, digest)
    assert cast.scaling == exact.scaling and set(cast.a) == set(exact.a) == set(spec.targets)
    for t in exact.a:
        assert cast.a[t].dtype == cast.b[t].dtype == torch.bfloat16
        assert torch.equal(cast.a[t], exact.a[t].to(torch.bfloat16)), f"{t}: A is the file's, cast once"
        assert torch.equal(cast.b[t], exact.b[t].to(torch.bfloat16)), f"{t}: B folded in float32, then cast"
    if world_size == 1:  # the folded B rounded once to bf16: within bf16's precision of PEFT's delta
        assert_serves_peft(pm, cast, spec, tol=2e-2)


def test_a_bf16_file_serves_unfolded_modules_bit_for_bit_in_a_bf16_store(bf16_adapter):
    """q_proj and gate/up_proj take the node's scaling: their factors are the file's bytes, whatever the path."""
    pm, path, spec, digest = bf16_adapter
    store = LoraAdapterStore(spec, pin=False, dtype=torch.bfloat16)
    for adapter in (store.read("ad", path), store.read("ad", path, digest)):
        assert adapter.scaling == 2.0, "lora_alpha 8 / r 4: the scaling most modules share"
        for module, layer in lora_modules(pm).items():
            if not module.endswith(("q_proj", "gate_proj", "up_proj")):
                continue
            target, index, s = spec.locate(module)
            tl = store.layout.targets[target]
            a = adapter.a[target][index, tl.a_rows(s)][:4]
            b = adapter.b[target][index, tl.b_rows(s), :4]
            assert torch.equal(a, layer.lora_A["default"].weight.bfloat16()), module
            assert torch.equal(b, layer.lora_B["default"].weight.bfloat16()), module
