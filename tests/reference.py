"""DESIGN.md's formula for the delta a slot gives, and PEFT's own delta, module by module."""

from __future__ import annotations

import torch

from mstar.engine.resources.lora.spec import LoraSpec

VISION_MODULES = ["qkv", "attn.proj", "fc1", "fc2", "patch_embed.proj", "merger.mlp.0", "merger.mlp.2"]
VISION_25_MODULES = ["qkv", "attn.proj", "gate_proj", "up_proj", "down_proj", "patch_embed.proj", "merger.mlp.0",
                     "merger.mlp.2"]


def slot_delta(a: torch.Tensor, b: torch.Tensor, scaling: float, spec: LoraSpec, module: str, x: torch.Tensor,
               world_size: int = 1) -> torch.Tensor:
    """delta(x)[slice s] = scaling * (x @ a[l, s*R:(s+1)*R].T) @ b[l, rows of s].T, slices concatenated."""
    target, layer, s = spec.locate(module)
    t, R = spec.targets[target], spec.max_rank
    shards = t.shard(0, world_size).widths()
    outs = []
    for sl in range(t.slices) if s is None else (s,):
        rows = slice(sum(shards[:sl]), sum(shards[: sl + 1]))
        outs.append(scaling * (x @ a[target][layer, sl * R : (sl + 1) * R].T) @ b[target][layer, rows].T)
    return torch.cat(outs, -1)


def lora_modules(peft_model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """PEFT's LoRA layers by module name as checkpoints spell it (less base_model.model.)."""
    from peft.tuners.lora import LoraLayer

    return {n.removeprefix("base_model.model."): m for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)}


def peft_delta(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """lora_layer(x) - base_layer(x) as PEFT computes it, flattened to [tokens, out] for a conv."""
    with torch.no_grad():
        return (layer(x) - layer.base_layer(x)).flatten(1)


def module_input(layer: torch.nn.Module, tokens: int, generator: torch.Generator) -> torch.Tensor:
    base = layer.base_layer
    if isinstance(base, torch.nn.Conv3d):
        return torch.randn(tokens, base.in_channels, *base.kernel_size, generator=generator)
    return torch.randn(tokens, base.in_features, generator=generator)


def assert_serves_peft(pm: torch.nn.Module, adapter, spec: LoraSpec, tol: float = 1e-5, tokens: int = 4) -> set[str]:
    """Every module of pm (a PEFT model holding float32 values) that spec maps gives PEFT's own delta from
    adapter's layout, to tol; returns the modules checked."""
    g = torch.Generator().manual_seed(0)
    checked = set()
    for module, layer in lora_modules(pm).items():
        if spec.locate(module) is None:
            continue
        x = module_input(layer, tokens, g)
        a = {t: v.float() for t, v in adapter.a.items()}
        b = {t: v.float() for t, v in adapter.b.items()}
        got = slot_delta(a, b, adapter.scaling, spec, module, x.flatten(1))
        torch.testing.assert_close(got, peft_delta(layer, x), rtol=tol, atol=tol, msg=module)
        checked.add(module)
    return checked
