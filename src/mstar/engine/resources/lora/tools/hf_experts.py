"""The pool's expert LoRA inside a transformers mixture-of-experts model (Qwen3-MoE, Mixtral, gpt-oss).

A token without an adapter takes the experts' own forward, untouched; a token with one is computed again,
expert by expert as the eager forward does, with each routed expert's slices of its slot added: gate and
up (slices 2e, 2e + 1) to the stacked gate_up projection, down (slice e) to the down projection.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..apply import lora_deltas
from ..pool import LoraDevicePool


class LoraExperts(nn.Module):
    """A transformers experts module with the experts pool's delta for each token's slot."""

    def __init__(self, base: nn.Module, pool: LoraDevicePool, layer: int, slots) -> None:
        super().__init__()
        self.base, self.pool, self.layer, self.slots = base, pool, layer, slots
        self.transposed = hasattr(base, "gate_up_proj_bias")  # gpt-oss: [E, in, out], biased, interleaved

    def forward(self, hidden_states: torch.Tensor, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        out = self.base(hidden_states, *args, **kwargs)
        # (top_k_index, top_k_weights), or gpt-oss's (router_indices, routing_weights), by position or by name
        index, weights = [*args, *kwargs.values()][:2]
        slots = self.slots.for_tokens("experts", hidden_states.shape[0])
        adapted = (slots >= 0).nonzero().squeeze(1)
        if len(adapted):
            out[adapted] = self._adapted(hidden_states[adapted], index[adapted], weights[adapted], slots[adapted])
        return out

    def _adapted(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
                 ) -> torch.Tensor:
        base, final = self.base, torch.zeros_like(x)
        for e in torch.unique(index).tolist():
            pos, tokens = torch.where((index == e).T)
            h, mine = x[tokens], slots[tokens]
            if self.transposed:
                gate_up = h @ base.gate_up_proj[e] + base.gate_up_proj_bias[e]
                for idx, delta in lora_deltas(h, self.pool, "experts_gate_up", self.layer, mine, (2 * e, 2 * e + 1)):
                    gate, up = delta.to(gate_up.dtype).chunk(2, dim=-1)
                    gate_up[idx, 0::2] += gate
                    gate_up[idx, 1::2] += up
                act = base._apply_gate(gate_up)
                down = act @ base.down_proj[e] + base.down_proj_bias[e]
            else:
                gate_up = nn.functional.linear(h, base.gate_up_proj[e])
                for idx, delta in lora_deltas(h, self.pool, "experts_gate_up", self.layer, mine, (2 * e, 2 * e + 1)):
                    gate_up.index_add_(0, idx, delta.to(gate_up.dtype))
                gate, up = gate_up.chunk(2, dim=-1)
                act = base.act_fn(gate) * up
                down = nn.functional.linear(act, base.down_proj[e])
            for idx, delta in lora_deltas(act, self.pool, "experts_down", self.layer, mine, e):
                down.index_add_(0, idx, delta.to(down.dtype))
            final.index_add_(0, tokens, (down * weights[tokens, pos, None]).to(final.dtype))
        return final


def attach_experts(model: nn.Module, pool: LoraDevicePool, slots) -> list[str]:
    """Wrap every experts module of model (one with stacked gate_up_proj and down_proj) in LoraExperts."""
    done = []
    for name, module in list(model.named_modules()):
        if name.endswith(".experts") and hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
            layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, LoraExperts(module, pool, layer, slots))
            done.append(name)
    return done
