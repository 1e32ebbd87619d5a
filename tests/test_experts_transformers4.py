"""Expert adapters PEFT 0.21.2 makes under transformers 4.57.1, served with PEFT's own deltas: gpt-oss's
stacked experts with lora_A on the output side (its experts carry no is_transposed there), and Qwen3-MoE's and
Mixtral's module per expert. scripts/setup.sh installs that transformers into .venv/transformers-4.57.1; the
adapters are made in a subprocess with it first on PYTHONPATH (make_tf4_adapters.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from make_tf4_adapters import CASES
from moe import EXPERTS, PER_EXPERT, assert_deltas, read, specs, stacked_as_linear
from safetensors.torch import load_file

from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file

TRANSFORMERS_4 = Path(sys.prefix) / "transformers-4.57.1"
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    if not (TRANSFORMERS_4 / "transformers").is_dir():
        why = f"{TRANSFORMERS_4} is missing: scripts/setup.sh installs transformers 4.57.1 there"
        if os.environ.get("CI"):
            pytest.fail(why)  # CI runs setup.sh, so there it is a broken setup, not a choice
        pytest.skip(why)
    out = tmp_path_factory.mktemp("transformers4")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TRANSFORMERS_4), str(HERE)])}
    run = subprocess.run([sys.executable, str(HERE / "make_tf4_adapters.py"), str(out)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"make_tf4_adapters.py under transformers 4.57.1 failed:\n{run.stderr[-4000:]}"
    assert json.loads((out / "versions.json").read_text())["transformers"] == "4.57.1"
    return out


def peft_deltas(case: Path, family: str, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """PEFT's (gate_up, down) deltas at layer as a linear's [E, out, in], gate rows then up rows."""
    d = load_file(case / "deltas.safetensors")
    at = f"model.layers.{layer}."
    if family == "gpt_oss":
        return stacked_as_linear(family, d.get(at + "mlp.experts.gate_up_proj"), d.get(at + "mlp.experts.down_proj"))
    prefix, (gate, up, down) = PER_EXPERT[family]
    name = at + prefix + "{proj}"
    return (torch.stack([torch.cat([d[name.format(e=e, proj=gate)], d[name.format(e=e, proj=up)]])
                         for e in range(EXPERTS)]),
            torch.stack([d[name.format(e=e, proj=down)] for e in range(EXPERTS)]))


@pytest.mark.parametrize("case", ["gpt_oss", "gpt_oss_even", "qwen3_moe", "mixtral"])
def test_transformers_4_adapters_give_peft_delta_for_every_expert(made, case):
    family, config, _ = CASES[case]
    spec, adapter = read(family, made / case, **config)
    for layer in range(2):
        assert_deltas(adapter, spec, *peft_deltas(made / case, family, layer), layer, f"{case} layer {layer}")


def test_gpt_oss_under_transformers_4_has_lora_a_on_the_output_side(made):
    """What the README says of transformers 4.57.1 with PEFT 0.21.2: gate_up_proj's lora_A is [r * E, 2I]
    and its lora_B [H, r * E]; down_proj's [r * E, H] and [I, r * E]."""
    tensors = load_file(made / "gpt_oss" / "adapter_model.safetensors")
    layer = "base_model.model.model.layers.0.mlp.experts."
    shapes = {k.removeprefix(layer): list(v.shape) for k, v in tensors.items() if k.startswith(layer)}
    assert shapes == {"base_layer.lora_A.weight": [8, 48], "base_layer.lora_B.weight": [32, 8],
                      "lora_A.weight": [8, 32], "lora_B.weight": [24, 8]}


def test_a_square_expert_alone_under_transformers_4_is_refused(made):
    family, config, _ = CASES["gpt_oss_square_down"]
    s = specs(family, **config)
    path = made / "gpt_oss_square_down"
    why = (r"model\.layers\.0\.mlp\.experts\.down_proj: its stacked factors fit either way round \(32 inputs and 32 "
           r"outputs per expert\) and no other stacked expert in the file shows which")
    with pytest.raises(ValueError, match=why):
        check_adapter_file(s["language_model"], "sq", path, [s["experts"]])
    with pytest.raises(ValueError, match=why):
        LoraAdapterStore(s["experts"], pin=False).read("sq", path)
