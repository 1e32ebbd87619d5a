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


def sample_modules(
    spec: LoraSpec, rank: int, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16, layers: range | None = None,
    targets: Iterable[str] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random (A, B) for every linear (of targets, if given) of every layer (of layers, if given) of a
    decoder spec, named as transformers names them."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for target in targets or DECODER_MODULES:
        t, modules = spec.targets[target], DECODER_MODULES[target]
        for layer in layers or range(t.layers):
            for s, suffix in modules:
                a = torch.randn(rank, t.in_features, generator=g) / t.in_features**0.5
                b = torch.randn(t.out_features[s], rank, generator=g) * 0.01
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
