"""The Triton kernels of add_lora: shrink (h = x Aᵀ) and expand (out += scaling · h Bᵀ) over the pool's slabs.

Both read a layer's A and B of every slot where the pool keeps them (pool.a[target][:, layer] is
[slots, slices * R, in] with one block between slots, pool.b[target][:, layer] [slots, out, R]), with
no gather and no copy. One launch covers every slice the call names and every tile of the step's
LoraBatch, whichever slot it uses; a tile of no slot, a rank block past the slot's real rank, and an
output block past its slice return at once, so the grid depends only on the token count, the pool
and the target. Each slot's real rank per slice (pool.ranks) bounds the rows of A and the columns of B
read: the padding to R is never loaded, and is multiplied only up to the next 16 rows (the smallest
block a tensor core takes).

On the CPU they run under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported), which
is how they are tested without a GPU.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .batch import DECODE_BLOCK_M, LoraBatch
from .layout import TargetLayout
from .pool import LoraDevicePool
from .spec import Slices

# triton.jit decides at decoration whether a kernel is interpreted, so this is read with the kernels (from the
# environment, as triton reads it, where a triton before 3.4 has no knobs).
_knobs = getattr(triton, "knobs", None)
_INTERPRETED = bool(_knobs.runtime.interpret) if _knobs else os.environ.get("TRITON_INTERPRET", "0").lower() in (
    "1", "true", "on", "yes")


def interpreting() -> bool:
    """Whether these kernels run under triton's interpreter (TRITON_INTERPRET=1), as they must on the CPU."""
    return _INTERPRETED


BLOCK_R = 16  # rank rows per program (shrink) and per step (expand): padding is skipped at this grain


class Blocks(NamedTuple):
    """Tile shapes of one launch pair: the tokens' block_m comes from the LoraBatch."""

    k: int  # input columns per shrink step
    n: int  # output columns per expand program
    split_k: int  # shrink programs sharing one tile's input columns (summed by atomic adds)
    warps: int = 4
    stages: int = 2


def blocks_for(batch: LoraBatch, in_features: int) -> Blocks:
    """Decode tiles hold a token or a few, so each program is mostly reading weights: wide input steps,
    and the input split across programs so a small batch still spreads over the GPU. Prefill tiles are
    tall, so the weights are read once for many tokens and the output blocks are wide."""
    if batch.block_m <= DECODE_BLOCK_M:
        return Blocks(k=256, n=64, split_k=max(1, min(4, in_features // 1024)), stages=3)
    return Blocks(k=128, n=128, split_k=1, stages=3)


@functools.lru_cache(maxsize=4096)
def _slice_table(layout: TargetLayout, covered: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Per slice the call covers, in its order: (slice, its first row of B, its width, its first column of
    out). Built once per target, slices and device; a CUDA graph capture should follow a warm-up call."""
    rows, at = [], 0
    for s in covered:
        b = layout.b_rows(s)
        rows.append((s, b.start, b.stop - b.start, at))
        at += b.stop - b.start
    return torch.tensor(rows, dtype=torch.int32, device=device)


def add_lora_triton(out: torch.Tensor, x: torch.Tensor, pool: LoraDevicePool, target: str, layer: int,
                    batch: LoraBatch, slice_: Slices = None, blocks: Blocks | None = None) -> torch.Tensor:
    """add_lora's "triton" backend: the shrink and the expand, two launches for any mix of slots."""
    t = pool.layout.targets[target]
    covered = tuple(t.target.covered(slice_))
    width = sum(t.b_rows(s).stop - t.b_rows(s).start for s in covered)
    if out.shape != (batch.tokens, width) or x.shape != (batch.tokens, t.a_shape[2]):
        raise ValueError(f"target {target}: x {list(x.shape)} and out {list(out.shape)} do not fit "
                         f"[{batch.tokens}, {t.a_shape[2]}] and [{batch.tokens}, {width}]")
    if not x.device == out.device == pool.scaling.device:
        raise ValueError(f"target {target}: x on {x.device} and out on {out.device}, the pool on {pool.scaling.device}")
    if batch.tile_slot.numel() == 0:
        return out
    blocks = blocks or blocks_for(batch, t.a_shape[2])
    return expand(out, shrink(x, pool, target, layer, batch, covered, blocks), pool, target, layer, batch, covered,
                  blocks)


def shrink(x: torch.Tensor, pool: LoraDevicePool, target: str, layer: int, batch: LoraBatch,
           covered: tuple[int, ...], blocks: Blocks, h: torch.Tensor | None = None) -> torch.Tensor:
    """h [tokens in sorted order, covered slices * R], float32: h[pos, j*R + i] = x[token at pos] · row i of
    slice covered[j] of its slot's A, for i below that slot's rank; the columns past it are not written."""
    t = pool.layout.targets[target]
    R, K = t.max_rank, t.a_shape[2]
    a, ranks = pool.a[target][:, layer], pool.ranks[target][:, layer]
    if h is None:  # split sums add into h; otherwise every column read later is written first
        h = (torch.zeros if blocks.split_k > 1 else torch.empty)(
            batch.tokens, len(covered) * R, dtype=torch.float32, device=x.device)
    grid = (batch.tile_slot.numel(), len(covered), triton.cdiv(R, BLOCK_R) * blocks.split_k)
    _shrink[grid](
        x, a, h, batch.order, batch.tile_slot, batch.tile_start, batch.tile_end, ranks,
        _slice_table(t, covered, x.device), K, R, x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        h.stride(0), h.stride(1), ranks.stride(0), ranks.stride(1),
        BLOCK_M=batch.block_m, BLOCK_R=BLOCK_R, BLOCK_K=blocks.k, SPLIT_K=blocks.split_k,
        PRECISION=_precision(a), num_warps=blocks.warps, num_stages=blocks.stages,
    )
    return h


def expand(out: torch.Tensor, h: torch.Tensor, pool: LoraDevicePool, target: str, layer: int, batch: LoraBatch,
           covered: tuple[int, ...], blocks: Blocks) -> torch.Tensor:
    """out[token, columns of covered[j]] += scaling of its slot * h[its position, j*R : j*R + rank] · B's rows
    of that slice, columns 0 : rank."""
    t = pool.layout.targets[target]
    b, ranks = pool.b[target][:, layer], pool.ranks[target][:, layer]
    widest = max(t.b_rows(s).stop - t.b_rows(s).start for s in covered)
    _expand[(batch.tile_slot.numel(), len(covered), triton.cdiv(widest, blocks.n))](
        h, b, out, batch.order, batch.tile_slot, batch.tile_start, batch.tile_end, ranks,
        _slice_table(t, covered, out.device), pool.scaling, t.max_rank, h.stride(0), h.stride(1),
        b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1), ranks.stride(0), ranks.stride(1),
        BLOCK_M=batch.block_m, BLOCK_N=blocks.n, BLOCK_R=BLOCK_R, PRECISION=_precision(b),
        num_warps=blocks.warps, num_stages=blocks.stages,
    )
    return out


def _precision(w: torch.Tensor) -> str:
    return "ieee" if w.dtype == torch.float32 else "tf32"  # float32 slots are multiplied exactly


@triton.jit
def _tile(order_ptr, tile_start_ptr, tile_end_ptr, tile, BLOCK_M: tl.constexpr):
    """A tile's sorted positions (an int64 range with its mask) and the tokens at them."""
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    pos = start + tl.arange(0, BLOCK_M)
    live = pos < end
    tokens = tl.load(order_ptr + pos, mask=live, other=0).to(tl.int64)
    return pos.to(tl.int64), live, tokens


@triton.jit
def _shrink(x_ptr, a_ptr, h_ptr, order_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, ranks_ptr, table_ptr,
            K, R, sx_t, sx_k, sa_slot, sa_row, sa_k, sh_t, sh_c, sr_slot, sr_slice,
            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
            PRECISION: tl.constexpr):
    """h[pos, j*R + i] = x[token at pos] · A[slot, s*R + i] for rows i below the slot's rank of slice s,
    where j is the program's slice (the j-th the call covers, s the slice it is)."""
    tile, j, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    s = tl.load(table_ptr + j * 4)
    rank = tl.load(ranks_ptr + slot.to(tl.int64) * sr_slot + s * sr_slice)
    r0 = (which // SPLIT_K) * BLOCK_R
    if r0 >= rank:
        return
    pos, live, tokens = _tile(order_ptr, tile_start_ptr, tile_end_ptr, tile, BLOCK_M)
    rows = r0 + tl.arange(0, BLOCK_R)
    real = rows < rank
    a_rows = a_ptr + slot.to(tl.int64) * sa_slot + (s * R + rows).to(tl.int64) * sa_row
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = (which % SPLIT_K) * per_split
    k_hi = tl.minimum(k_lo + per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        kin = ks < k_hi
        at = tl.load(a_rows[:, None] + ks[None, :] * sa_k, mask=real[:, None] & kin[None, :], other=0.0)
        xt = tl.load(x_ptr + tokens[:, None] * sx_t + ks[None, :] * sx_k, mask=live[:, None] & kin[None, :],
                     other=0.0)
        acc += tl.dot(xt.to(at.dtype), tl.trans(at), input_precision=PRECISION)
    h = h_ptr + pos[:, None] * sh_t + (j * R + rows)[None, :] * sh_c
    if SPLIT_K == 1:
        tl.store(h, acc, mask=live[:, None] & real[None, :])
    else:
        tl.atomic_add(h, acc, mask=live[:, None] & real[None, :])


@triton.jit
def _expand(h_ptr, b_ptr, out_ptr, order_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, ranks_ptr, table_ptr,
            scaling_ptr, R, sh_t, sh_c, sb_slot, sb_row, sb_r, so_t, so_c, sr_slot, sr_slice,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    """out[token at pos, column c of slice j] += scaling[slot] · h[pos, j*R : j*R + rank] · B[slot, row of c,
    :rank], each output element written by one program."""
    tile, j, nb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    s = tl.load(table_ptr + j * 4)
    width = tl.load(table_ptr + j * 4 + 2)
    n0 = nb * BLOCK_N
    rank = tl.load(ranks_ptr + slot.to(tl.int64) * sr_slot + s * sr_slice)
    if (n0 >= width) | (rank == 0):
        return
    b_row = tl.load(table_ptr + j * 4 + 1)
    col = tl.load(table_ptr + j * 4 + 3)
    pos, live, tokens = _tile(order_ptr, tile_start_ptr, tile_end_ptr, tile, BLOCK_M)
    ns = n0 + tl.arange(0, BLOCK_N)
    nin = ns < width
    b_cols = b_ptr + slot.to(tl.int64) * sb_slot + (b_row + ns).to(tl.int64) * sb_row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, rank, BLOCK_R):
        rs = r + tl.arange(0, BLOCK_R)
        real = rs < rank
        bt = tl.load(b_cols[None, :] + rs[:, None] * sb_r, mask=real[:, None] & nin[None, :], other=0.0)
        ht = tl.load(h_ptr + pos[:, None] * sh_t + (j * R + rs)[None, :] * sh_c, mask=live[:, None] & real[None, :],
                     other=0.0)
        acc += tl.dot(ht.to(bt.dtype), bt, input_precision=PRECISION)
    acc *= tl.load(scaling_ptr + slot)
    o = out_ptr + tokens[:, None] * so_t + (col + ns)[None, :] * so_c
    m = live[:, None] & nin[None, :]
    tl.store(o, (tl.load(o, mask=m, other=0.0).to(tl.float32) + acc).to(o.dtype.element_ty), mask=m)
