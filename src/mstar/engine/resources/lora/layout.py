"""An adapter's weights copied from a memory map into this rank's slot layout.

With R = max_rank, module (layer l, slice s, rank r) fills a[t][l, s*R : s*R + r] with its A
(this rank's input columns for a row target) and, in b[t][l], the rows of slice s that this
rank holds, columns 0 : r, with its B. Everything else is zero.
"""

from __future__ import annotations

import mmap

import torch

from .check import as_linear
from .checkpoint import Checkpoint
from .host_memory import buffer_bytes, carve, host_buffer
from .safetensors_header import TensorEntry
from .spec import LoraSpec, LoraTarget

Placed = tuple[int, "int | None", str, TensorEntry, TensorEntry]  # layer, slice, module, A, B


def adapter_scaling(ckpt: Checkpoint) -> float:
    """The adapter's scaling; 1 where lora_alpha is 0, so module scalings can still be folded."""
    return ckpt.config.scaling or 1.0


def place(ckpt: Checkpoint, spec: LoraSpec) -> dict[str, list[Placed]]:
    """The modules spec serves, by target; modules it does not map are other nodes'."""
    placed: dict[str, list[Placed]] = {}
    for module, roles in sorted(ckpt.modules(spec.convert_keys).items()):
        loc = spec.locate(module)
        if loc is not None:
            target, layer, s = loc
            placed.setdefault(target, []).append((layer, s, module, roles["A"], roles["B"]))
    return placed


def tensor_at(mm: mmap.mmap, e: TensorEntry) -> torch.Tensor:
    """The tensor e describes, as a view of the mapped file (no bytes read until used)."""
    n = 1
    for d in e.shape:
        n *= d
    return torch.frombuffer(mm, dtype=e.torch_dtype, count=n, offset=e.start).view(as_linear(e.shape))


def read_layout(
    ckpt: Checkpoint, spec: LoraSpec, mm: mmap.mmap, rank: int, world_size: int, dtype: torch.dtype, pin: bool
) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(largest rank served, a, b) for this rank, in one host buffer of exactly the layout's size."""
    placed = place(ckpt, spec)
    R = spec.max_rank
    shapes = []
    for name in placed:
        t = spec.targets[name]
        shapes += [t.a_shape(R, world_size), t.b_shape(R, world_size)]
    views = carve(host_buffer(buffer_bytes(shapes, dtype), pin), shapes, dtype)
    a = dict(zip(placed, views[0::2], strict=True))
    b = dict(zip(placed, views[1::2], strict=True))
    top, scaling = 0, adapter_scaling(ckpt)
    for name, modules in placed.items():
        t = spec.targets[name]
        filled: dict[tuple[int, int], int] = {}
        for layer, s, module, ea, eb in modules:
            r = ea.shape[0]
            ratio = ckpt.config.module_scaling(module) / scaling
            copy_module(t, a[name][layer], b[name][layer], tensor_at(mm, ea), tensor_at(mm, eb), s, ratio, R, rank, world_size)
            for sl in _slices(t, s):
                filled[(layer, sl)] = r
            top = max(top, r)
        zero_rest(t, a[name], b[name], filled, R, world_size)
    return top, a, b


def _slices(t: LoraTarget, s: int | None) -> range:
    return range(t.slices) if s is None else range(s, s + 1)


def copy_module(
    t: LoraTarget,
    a: torch.Tensor,
    b: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    s: int | None,
    ratio: float,
    R: int,
    rank: int,
    world_size: int,
) -> None:
    """One module's A and B into one layer's a [slices*R, in_shard] and b [out_shard, R].

    The sharding rule: a row target splits A's input columns (B whole); a column target keeps
    A whole and gives each slice's B rows to ranks by heads (or rows); a module covering every
    slice (s None) has its A written into each slice and its B split at the slices' widths.
    """
    r = A.shape[0]
    c0, c1 = t.a_columns(rank, world_size)
    if ratio != 1.0:  # the module's own scaling, folded in float32 before the cast
        B = B.float() * ratio
    out_shards = t.out_shards(world_size)
    for sl in _slices(t, s):
        a[sl * R : sl * R + r].copy_(A[:, c0:c1])
        r0, r1 = t.b_rows(sl, rank, world_size)
        src0 = 0 if s is not None else sum(t.out_features[:sl])
        dst0 = sum(out_shards[:sl])
        b[dst0 : dst0 + r1 - r0, :r].copy_(B[src0 + r0 : src0 + r1])


def zero_rest(
    t: LoraTarget, a: torch.Tensor, b: torch.Tensor, filled: dict[tuple[int, int], int], R: int, world_size: int
) -> None:
    """Zero every row of a and column of b that no module filled: padding and untouched layers."""
    out_shards = t.out_shards(world_size)
    for layer in range(t.layers):
        dst0 = 0
        for sl in range(t.slices):
            r = filled.get((layer, sl), 0)
            if r < R:
                a[layer, sl * R + r : (sl + 1) * R].zero_()
                b[layer, dst0 : dst0 + out_shards[sl], r:].zero_()
            dst0 += out_shards[sl]
