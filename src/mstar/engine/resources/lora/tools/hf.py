"""The pool hooked into a transformers model: each adapted linear (or conv) gets the pool's delta.

This is how the demo and the end-to-end tests run a mixed batch; an engine's own fused layers
would call add_lora the same way. With world_size > 1 the base weights are sharded by the same
rule as the adapters and row-parallel outputs are all-reduced.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..apply import Backend, add_lora
from ..batch import LoraBatch
from ..pool import LoraDevicePool
from ..spec import LoraTarget


class TokenSlots:
    """Which slot each token of the next forward uses, per node: rows of the language model's batch,
    and the vision tower's patches (in the order the tower sees them). -1 is no adapter. Each node's
    LoraBatch is built once per forward, at its first layer, and read by every other."""

    def __init__(self) -> None:
        self._rows = torch.empty(0, dtype=torch.long)
        self._patches = torch.empty(0, dtype=torch.long)
        self._batches: dict[str, tuple[int, LoraBatch]] = {}  # per node, the last forward's
        self.builds = 0  # LoraBatches built, so a test can tell they are shared

    @property
    def rows(self) -> torch.Tensor:
        return self._rows

    @rows.setter
    def rows(self, slots: torch.Tensor) -> None:
        self._rows, self._batches = slots, {}

    @property
    def patches(self) -> torch.Tensor:
        return self._patches

    @patches.setter
    def patches(self, slots: torch.Tensor) -> None:
        self._patches, self._batches = slots, {}

    def batch(self, node: str, tokens: int, slot_count: int) -> LoraBatch:
        """The node's tokens grouped by slot, built at the first call of a forward and shared after (a
        forward of another token count, the next step's, builds its own)."""
        if node not in self._batches or self._batches[node][0] != tokens:
            self._batches[node] = (tokens, LoraBatch.build(self.for_tokens(node, tokens), slot_count))
            self.builds += 1
        return self._batches[node][1]

    def for_tokens(self, node: str, tokens: int) -> torch.Tensor:
        if node == "vision_tower":
            if tokens and len(self.patches) % tokens == 0 and len(self.patches) > tokens:  # the merger's tokens,
                return self.patches[:: len(self.patches) // tokens]  # each of consecutive patches of one image
            if len(self.patches) != tokens:
                raise ValueError(f"{tokens} vision tokens, but slots were given for {len(self.patches)}")
            return self.patches
        if not len(self.rows) or tokens % len(self.rows):
            raise ValueError(f"{tokens} tokens do not split into the {len(self.rows)} rows slots were given for")
        return self.rows.repeat_interleave(tokens // len(self.rows))


class LoraLayer(nn.Module):
    """A base linear or conv, sharded for this rank, plus the pool's delta for each token's slot."""

    def __init__(self, base: nn.Module, pool: LoraDevicePool, node: str, target: str, layer: int,
                 slice_: int | None, slots: TokenSlots, backend: Backend | None = None) -> None:
        super().__init__()
        self.base, self.pool, self.node, self.target, self.layer, self.slice_ = base, pool, node, target, layer, slice_
        self.slots, self.backend = slots, backend
        t = pool.spec.targets[target]
        self.reduce = t.parallel == "row" and pool.world_size > 1
        if pool.world_size > 1:
            shard_base(base, t, slice_, pool.rank, pool.world_size)

    @property
    def weight(self) -> torch.Tensor:  # models read their layers' weight dtype (Qwen2-VL's patch embedding)
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        tokens = x.shape[0] if isinstance(self.base, nn.Conv3d) else x[..., 0].numel()
        flat_x = x.reshape(tokens, -1)
        flat_y = y.view(tokens, -1)  # a conv whose kernel is its stride gives [patches, out, 1, 1, 1]
        batch = self.slots.batch(self.node, tokens, self.pool.slots)
        add_lora(flat_y, flat_x, self.pool, self.target, self.layer, batch, self.slice_, backend=self.backend)
        if self.reduce:
            dist.all_reduce(y)
        return y


def shard_base(base: nn.Module, t: LoraTarget, slice_: int | None, rank: int, world_size: int) -> None:
    """The base layer's weight cut to this rank by the adapters' rule: a column target keeps each
    slice's rows for this rank, a row target its input columns (bias on rank 0 alone, as it is
    summed), a replicated one everything."""
    w = base.weight.data
    bias = base.bias.data if getattr(base, "bias", None) is not None else None
    shard = t.shard(rank, world_size)
    if t.parallel == "column":  # a module covering every slice holds them back to back, as its B does
        start = t.module_rows(slice_)
        keep = torch.cat([torch.arange(start[s] + shard.rows[s][0], start[s] + shard.rows[s][1])
                          for s in t.covered(slice_)])
        base.weight = nn.Parameter(w[keep].clone(), requires_grad=False)
        if bias is not None:
            base.bias = nn.Parameter(bias[keep].clone(), requires_grad=False)
    elif t.parallel == "row":
        c0, c1 = shard.columns
        base.weight = nn.Parameter(w[:, c0:c1].clone(), requires_grad=False)
        if bias is not None and rank != 0:
            base.bias = nn.Parameter(torch.zeros_like(bias), requires_grad=False)


def attach(model: nn.Module, pools: Mapping[str, LoraDevicePool], slots: TokenSlots,
           backend: Backend | None = None) -> list[str]:
    """Replace every module of model that a pool's spec maps with a LoraLayer, and with an experts pool
    every experts module with a LoraExperts, each running add_lora's backend (its default if None);
    their names."""
    from .hf_experts import attach_experts

    done = attach_experts(model, pools["experts"], slots, backend) if "experts" in pools else []
    for name, module in list(model.named_modules()):
        if not isinstance(module, (nn.Linear, nn.Conv3d)):
            continue
        for node, pool in pools.items():
            loc = pool.spec.locate(name)
            if loc is not None:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, LoraLayer(module, pool, node, *loc, slots, backend))
                done.append(name)
                break
    return done
