"""The pool's expert LoRA inside a transformers mixture-of-experts model (Qwen3-MoE, Mixtral, gpt-oss).

A token without an adapter takes the experts' own forward, untouched; a token with one is computed again,
expert by expert as the eager forward does, with each routed expert's slices of its slot added: gate and
up (slices 2e, 2e + 1) to the stacked gate_up projection, down (slice e) to the down projection.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..apply import Backend, add_lora
from ..pool import LoraDevicePool


class LoraExperts(nn.Module):
    """A transformers experts module with the experts pool's delta for each token's slot."""

    def __init__(self, base: nn.Module, pool: LoraDevicePool, layer: int, slots, backend: Backend | None = None,
                 ) -> None:
        super().__init__()
        self.base, self.pool, self.layer, self.slots, self.backend = base, pool, layer, slots, backend
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
                delta = self._lora(torch.zeros_like(gate_up), h, "experts_gate_up", mine, (2 * e, 2 * e + 1))
                gate, up = delta.chunk(2, dim=-1)
                gate_up[:, 0::2] += gate
                gate_up[:, 1::2] += up
                act = base._apply_gate(gate_up)
                down = act @ base.down_proj[e] + base.down_proj_bias[e]
            else:
                gate_up = self._lora(nn.functional.linear(h, base.gate_up_proj[e]), h, "experts_gate_up", mine,
                                     (2 * e, 2 * e + 1))
                gate, up = gate_up.chunk(2, dim=-1)
                act = base.act_fn(gate) * up
                down = nn.functional.linear(act, base.down_proj[e])
            self._lora(down, act, "experts_down", mine, e)
            final.index_add_(0, tokens, (down * weights[tokens, pos, None]).to(final.dtype))
        return final

    def _lora(self, out: torch.Tensor, x: torch.Tensor, target: str, slots: torch.Tensor, slice_) -> torch.Tensor:
        return add_lora(out, x, self.pool, target, self.layer, slots, slice_, backend=self.backend)


def attach_experts(model: nn.Module, pool: LoraDevicePool, slots, backend: Backend | None = None) -> list[str]:
    """Wrap every experts module of model (one with stacked gate_up_proj and down_proj) in LoraExperts."""
    done = []
    for name, module in list(model.named_modules()):
        if name.endswith(".experts") and hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
            layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, LoraExperts(module, pool, layer, slots, backend))
            done.append(name)
    return done
