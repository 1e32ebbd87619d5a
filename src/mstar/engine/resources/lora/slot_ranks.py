"""Each served module's real rank by target, layer and slice: what the kernels multiply, not max_rank.

A slot pads every module to max_rank with zeros; the rank it really has is known from the read's
plan (a module's A is [r, in]), so the device pool records it beside the weights at activation and
the kernels skip the padded rows of A and columns of B.
"""

from __future__ import annotations

import torch

from .checkpoint import Checkpoint
from .layout import SlotLayout
from .plan import plan


def slot_ranks(ckpt: Checkpoint, layout: SlotLayout) -> dict[str, torch.Tensor]:
    """target -> [layers, slices] int32 ranks of the modules layout's spec serves (0 where none), once per
    header: adapters of one recipe share it, so the tensors are read-only."""
    key = ("slot_ranks", layout)
    memo = ckpt.header.memo
    if key not in memo:
        memo[key] = _ranks(ckpt, layout)
    return memo[key]


def _ranks(ckpt: Checkpoint, layout: SlotLayout) -> dict[str, torch.Tensor]:
    p, R = plan(ckpt, layout), layout.spec.max_rank
    out = {n: torch.zeros(layout.targets[n].target.layers, layout.targets[n].target.slices, dtype=torch.int32)
           for n in p.targets}
    for piece in [r.piece for r in (*p.direct, *p.staged)] + list(p.mapped):
        if piece.role == "A":  # rows s*R : s*R + r of a[layer]
            out[piece.target][piece.layer, piece.to_rows[0] // R] = piece.to_rows[1] - piece.to_rows[0]
    for st in p.stacked:  # every expert's slices at the module's rank
        out[st.target][st.layer] = st.rank(layout.spec.targets[st.target])
    return out
