"""The reference LoRA op over a batch whose tokens use different adapters' slots."""

from __future__ import annotations

import torch

from .pool import LoraDevicePool


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    pool: LoraDevicePool,
    target: str,
    layer: int,
    slots: torch.Tensor,
    slice_: int | None = None,
) -> torch.Tensor:
    """out += scaling * (x Aᵀ) Bᵀ per slice, each token with its own slot's A, B and scaling.

    x is [tokens, in_shard] (a conv target's patches flattened, as as_linear reads its factors);
    slots is [tokens], -1 for a token with no adapter. out is the layer's output on this rank:
    [tokens, out_shard], or one slice's [tokens, its shard] when slice_ is given, as for a model
    whose base linears are not fused. For a row target it is the partial output that the
    all-reduce after the layer sums. Tokens are grouped by slot: clear, not fast.
    """
    t = pool.layout.targets[target]
    for slot in torch.unique(slots[slots >= 0]).tolist():
        idx = (slots == slot).nonzero().squeeze(1)
        a, b = pool.a[target][slot, layer], pool.b[target][slot, layer]
        xs = x.index_select(0, idx).to(a.dtype)
        h = xs @ a.T  # [tokens, slices * R]
        parts = [h[:, t.a_rows(s)] @ b[t.b_rows(s)].T for s in t.target.covered(slice_)]
        delta = torch.cat(parts, 1) * pool.scaling[slot]
        out.index_add_(0, idx, delta.to(out.dtype))
    return out
