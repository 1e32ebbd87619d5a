"""The LoRA op over a batch whose tokens use different adapters' slots, and its backends.

"torch" is the reference: tokens grouped by slot on the host, clear rather than fast. "triton" runs
kernels.py's two launches for any mix of slots, with no host synchronisation, on CUDA or (for tests)
under Triton's interpreter on the CPU. Both read each slot's real rank of A and B, never the padding to R.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal

import torch

from .batch import LoraBatch
from .pool import LoraDevicePool
from .spec import Slices

Backend = Literal["torch", "triton"]
BACKENDS = ("torch", "triton")


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    pool: LoraDevicePool,
    target: str,
    layer: int,
    slots: torch.Tensor | LoraBatch,
    slice_: Slices = None,
    *,
    backend: Backend | None = None,
) -> torch.Tensor:
    """out += scaling * (x Aᵀ) Bᵀ per slice, each token with its own slot's A, B and scaling.

    x is [tokens, in_shard] (a conv target's patches flattened, as as_linear reads its factors);
    slots is [tokens], -1 for a token with no adapter, or the step's LoraBatch, built once for every
    layer and target. out is the layer's output on this rank: [tokens, out_shard], or the slices
    slice_ names, side by side in its order, as for a model whose base linears are not fused, or one
    expert's (gate and up: slices 2e and 2e + 1). For a row target it is the partial output that the
    all-reduce after the layer sums. backend is "torch" or "triton"; by default Triton on CUDA where
    it is installed, else torch.
    """
    backend = backend or default_backend(x.device)
    if isinstance(slots, LoraBatch):
        slots.check(pool.slots, pool.scaling.device)  # the slabs' own device: "cuda" names no index
    if backend == "torch":
        return _add_lora_torch(out, x, pool, target, layer, slots.slots if isinstance(slots, LoraBatch) else slots,
                               slice_)
    if backend != "triton":
        raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
    if not triton_installed():
        raise ValueError('backend "triton" needs triton: pip install mstar-lora[triton]')
    from . import kernels

    if x.device.type == "cpu" and not kernels.interpreting():
        raise ValueError('backend "triton" on the CPU runs under Triton\'s interpreter: set TRITON_INTERPRET=1 '
                         "before triton is imported")
    batch = slots if isinstance(slots, LoraBatch) else LoraBatch.build(slots, pool.slots)
    return kernels.add_lora_triton(out, x, pool, target, layer, batch, slice_)


def default_backend(device: torch.device) -> Backend:
    """Triton on CUDA where it is installed, else the reference."""
    return "triton" if device.type == "cuda" and triton_installed() else "torch"


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _add_lora_torch(out: torch.Tensor, x: torch.Tensor, pool: LoraDevicePool, target: str, layer: int,
                    slots: torch.Tensor, slice_: Slices) -> torch.Tensor:
    t = pool.layout.targets[target]
    covered = t.target.covered(slice_)
    order = torch.argsort(slots, stable=True)  # tokens of no adapter first, then slot by slot
    counts = torch.bincount(slots + 1, minlength=pool.slots + 1).tolist()
    ranks, scaling = pool.ranks[target][:, layer].tolist(), pool.scaling.tolist()
    a, b = pool.a[target][:, layer], pool.b[target][:, layer]
    start = counts[0]
    for slot, n in enumerate(counts[1:]):
        if not n:
            continue
        idx, start = order[start : start + n], start + n
        xs = x.index_select(0, idx).to(a.dtype)
        parts = []
        for s in covered:
            r, first = ranks[slot][s], t.a_rows(s).start
            h = _times_transposed(xs, a[slot, first : first + r])  # [tokens, rank]
            parts.append(_times_transposed(h, b[slot, t.b_rows(s), :r]))
        delta = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
        # index_add_ would do, but on the CPU it starts threads for a few rows (milliseconds on a busy machine)
        out.index_put_((idx,), (delta * scaling[slot]).to(out.dtype), accumulate=True)
    return out


def _times_transposed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T, in x's dtype. On the CPU as a product summed over its last dimension, in float32, a few
    tokens at a time: a gemm this small runs on MKL's threads, which meet several times a call, so on a
    busy two-core machine each took milliseconds on two threads (16 ms for [18, 64] x [64, 24], 4 µs on
    one), where an elementwise op is one parallel region, or none below torch's grain size."""
    if x.device.type != "cpu":
        return x @ w.T
    step, wf = max(1, (1 << 22) // max(1, w.numel())), w.float()
    if len(x) <= step:
        return (x[:, None, :].float() * wf).sum(-1).to(x.dtype)
    return torch.cat([(x[i : i + step, None, :].float() * wf).sum(-1) for i in range(0, len(x), step)]).to(x.dtype)
