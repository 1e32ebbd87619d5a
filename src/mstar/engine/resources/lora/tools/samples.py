"""Sample PEFT-format adapters for a decoder spec: for the demo, benchmarks and a first try."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..checkpoint import CONFIG, WEIGHTS
from ..keys import PEFT_PREFIX
from ..spec import LoraSpec

# Each decoder target's modules as transformers names them, with the slice each fills.
DECODER_MODULES = {
    "qkv_proj": ((0, "self_attn.q_proj"), (1, "self_attn.k_proj"), (2, "self_attn.v_proj")),
    "o_proj": ((0, "self_attn.o_proj"),),
    "gate_up_proj": ((0, "mlp.gate_proj"), (1, "mlp.up_proj")),
    "down_proj": ((0, "mlp.down_proj"),),
}
# The same for a model whose base linears are fused already (Phi-3): one module covers every slice.
FUSED_MODULES = {
    "qkv_proj": ((None, "self_attn.qkv_proj"),),
    "o_proj": ((None, "self_attn.o_proj"),),
    "gate_up_proj": ((None, "mlp.gate_up_proj"),),
    "down_proj": ((None, "mlp.down_proj"),),
}


def decoder_modules(spec: LoraSpec) -> dict[str, tuple[tuple[int | None, str], ...]]:
    """The module names of spec's decoder targets, as its model names them: fused where the model fuses
    them, and only the targets it has (a mixture of experts' language model node has attention alone)."""
    fused = spec.locate("model.layers.0.self_attn.qkv_proj") is not None
    return {t: m for t, m in (FUSED_MODULES if fused else DECODER_MODULES).items() if t in spec.targets}


def sample_modules(
    spec: LoraSpec, rank: int, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16, layers: range | None = None,
    targets: Iterable[str] | None = None, b_std: float = 0.01,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random (A, B) for every linear (of targets, if given) of every layer (of layers, if given) of a
    decoder spec, named as transformers names them. b_std is B's spread: the demo wants adapters that
    change what a tiny model generates."""
    g = torch.Generator().manual_seed(seed)
    names = decoder_modules(spec)
    out = {}
    for target in targets or names:
        t = spec.targets[target]
        for layer in layers or range(t.layers):
            for s, suffix in names[target]:
                a = torch.randn(rank, t.in_features, generator=g) / t.in_features**0.5
                b = torch.randn(sum(t.out_features) if s is None else t.out_features[s], rank, generator=g) * b_std
                out[f"model.layers.{layer}.{suffix}"] = (a.to(dtype), b.to(dtype))
    return out


def write_peft_adapter(
    path: str | os.PathLike[str], modules: dict[str, tuple[torch.Tensor, torch.Tensor]], *, alpha: float, **config
) -> Path:
    """A PEFT adapter directory (adapter_config.json and adapter_model.safetensors) as PEFT saves one."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (a, b) in modules.items():
        tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.contiguous()
        tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b.contiguous()
    save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})
    rank = max(a.shape[0] for a, _ in modules.values())
    raw = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none", "use_rslora": False,
           "target_modules": sorted({n.rsplit(".", 1)[-1] for n in modules}), "task_type": "CAUSAL_LM", **config}
    (path / CONFIG).write_text(json.dumps(raw, indent=2))
    return path
