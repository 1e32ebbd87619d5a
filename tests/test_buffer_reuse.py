"""A host buffer let go by one adapter and taken by the next serves the next exactly as a fresh buffer would:
nothing of the first adapter stays in the padding, however the second's pieces are copied."""

from __future__ import annotations

import pytest
import torch
from tiny import make_adapter, model_config

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file

SPEC = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
# Second adapters that fill the same targets as a rank-8 one (so the same buffer size) but less of them: a
# dense rank-2 adapter on every layer, one whose ranks differ by module, one whose alphas fold into B.
SECOND = {
    "rank-2-every-layer": {"r": 2},
    "ranks-by-module": {"r": 2, "rank_pattern": {"k_proj": 8, "layers.1.mlp.down_proj": 4}},
    "folded": {"r": 8, "alpha_pattern": {"v_proj": 3}},
}


def storage(adapter) -> int:
    (ptr,) = {t.untyped_storage().data_ptr() for t in (*adapter.a.values(), *adapter.b.values())}
    return ptr


@pytest.mark.parametrize("verified", [False, True], ids=["shard-only", "with-digest"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("second", list(SECOND))
def test_a_reused_buffer_serves_what_a_fresh_one_does(tmp_path, second, dtype, verified):
    _, first_path = make_adapter(tmp_path, name="first", r=8, seed=1, dtype=dtype)
    _, path = make_adapter(tmp_path, name="second", seed=2, dtype=dtype, **SECOND[second])
    digest = check_adapter_file(SPEC, "second", path) if verified else None
    store = LoraAdapterStore(SPEC, pin=False, dtype=dtype)
    first = store.read("first", first_path)
    assert all(v.abs().amin(-1).amin(-1).gt(0).all() for v in first.b.values()), "rank 8 fills every column of b"
    ptr = storage(first)
    del first
    reused = store.read("second", path, digest)
    assert storage(reused) == ptr, "the premise: first's buffer, of the same size and free now, is taken again"
    fresh = LoraAdapterStore(SPEC, pin=False, dtype=dtype).read("second", path, digest)
    assert set(reused.a) == set(fresh.a) == set(SPEC.targets)
    for t in fresh.a:
        assert torch.equal(reused.a[t], fresh.a[t]), f"{t}: a holds the first adapter's rows"
        assert torch.equal(reused.b[t], fresh.b[t]), f"{t}: b holds the first adapter's columns"
