"""The reference LoRA op over a batch whose tokens use different adapters' slots."""

from __future__ import annotations

import torch

from .pool import LoraDevicePool
from .spec import Slices


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    pool: LoraDevicePool,
    target: str,
    layer: int,
    slots: torch.Tensor,
    slice_: Slices = None,
) -> torch.Tensor:
    """out += scaling * (x Aᵀ) Bᵀ per slice, each token with its own slot's A, B and scaling.

    x is [tokens, in_shard] (a conv target's patches flattened, as as_linear reads its factors);
    slots is [tokens], -1 for a token with no adapter. out is the layer's output on this rank:
    [tokens, out_shard], or the slices slice_ names, side by side in its order, as for a model whose
    base linears are not fused, or one expert's (gate and up: slices 2e and 2e + 1). For a row
    target it is the partial output that the all-reduce after the layer sums. Tokens are grouped by
    slot: clear, not fast.
    """
    for idx, delta in lora_deltas(x, pool, target, layer, slots, slice_):
        out.index_add_(0, idx, delta.to(out.dtype))
    return out


def lora_deltas(x: torch.Tensor, pool: LoraDevicePool, target: str, layer: int, slots: torch.Tensor,
                slice_: Slices = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens' indices, their delta) for every slot the tokens use: what add_lora adds, for a
    caller whose output lays the slices out otherwise (gpt-oss interleaves an expert's gate and up)."""
    t = pool.layout.targets[target]
    out = []
    for slot in torch.unique(slots[slots >= 0]).tolist():
        idx = (slots == slot).nonzero().squeeze(1)
        a, b = pool.a[target][slot, layer], pool.b[target][slot, layer]
        h = x.index_select(0, idx).to(a.dtype) @ a.T  # [tokens, slices * R]
        parts = [h[:, t.a_rows(s)] @ b[t.b_rows(s)].T for s in t.target.covered(slice_)]
        out.append((idx, torch.cat(parts, 1) * pool.scaling[slot]))
    return out
