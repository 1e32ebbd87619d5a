"""Adapters PEFT makes under transformers 4.57, run as a script with that transformers first on PYTHONPATH
(tests/transformers4.py runs it): `python make_tf4_adapters.py OUT`.

Each case is a folder under OUT with PEFT's adapter and, in deltas.safetensors, the delta PEFT itself gives
each adapted parameter or module (get_delta_weight), keyed by its module name without PEFT's prefix.
OUT/versions.json says which transformers and peft made them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import peft
import torch
import transformers
from moe import STACKED, build, randomize
from safetensors.torch import save_file

# name: (family, config overrides, LoraConfig arguments)
CASES = {
    # in and out differ for both parameters: the shapes tell which side A is on
    "gpt_oss": ("gpt_oss", {}, {"target_parameters": STACKED, "target_modules": ["q_proj"]}),
    # gpt-oss's own widths (intermediate_size == hidden_size): down_proj is square, gate_up_proj is not
    "gpt_oss_even": ("gpt_oss", {"intermediate_size": 32}, {"target_parameters": STACKED}),
    # nothing but a square parameter: nothing tells
    "gpt_oss_square_down": ("gpt_oss", {"intermediate_size": 32}, {"target_parameters": [STACKED[1]]}),
    # transformers 4 has a module per expert, so target_modules makes per-expert adapters
    "qwen3_moe": ("qwen3_moe", {}, {"target_modules": ["q_proj", "gate_proj", "up_proj", "down_proj"]}),
    "mixtral": ("mixtral", {}, {"target_modules": ["q_proj", "w1", "w2", "w3"]}),
}


def deltas(pm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """PEFT's delta of every adapted parameter (as the parameter is laid out) or module (as a linear's)."""
    out = {}
    for name, module in pm.named_modules():
        if not isinstance(module, peft.tuners.lora.LoraLayer):
            continue
        name = name.removeprefix("base_model.model.")
        if isinstance(module, peft.tuners.lora.ParamWrapper):  # nested: gate_up_proj's wraps the experts
            name = name.replace(".base_layer", "") + "." + module.parameter_name
        out[name] = module.get_delta_weight("default").detach().contiguous()
    return out


def main(out: Path) -> None:
    for case, (family, over, lora) in CASES.items():
        pm = peft.get_peft_model(build(family, **over), peft.LoraConfig(r=2, lora_alpha=4, **lora))
        randomize(pm, seed=len(case))
        pm.save_pretrained(out / case)
        save_file(deltas(pm), out / case / "deltas.safetensors")
    (out / "versions.json").write_text(json.dumps({"transformers": transformers.__version__,
                                                   "peft": peft.__version__}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
