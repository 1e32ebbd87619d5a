"""The README's code runs as it stands, and does what it says."""

from __future__ import annotations

import re
from pathlib import Path

import peft
import torch
import transformers

from mstar.engine.resources.lora.models import load_config, specs_from_config
from mstar.engine.resources.lora.tools import demo

README = Path(__file__).parents[1] / "README.md"


def python_block(heading: str) -> str:
    """The first python block under heading."""
    section = README.read_text().split(f"\n## {heading}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_step_loop_runs_on_this_device_and_serves_every_row_as_peft_does(tmp_path, monkeypatch):
    spec = specs_from_config("tiny-llama", max_rank=demo.MAX_RANK)["language_model"]
    demo.write_samples(spec, tmp_path / "demo-adapters")  # what `mstar-lora demo --keep demo-adapters` writes
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(python_block("The manager: an engine's step loop"), "README.md", "exec"), ns)
    assert sorted(ns["logits"]) == [0, 1, 2, 3], "every request was served"
    base = {k.replace(".base.", "."): v.cpu() for k, v in ns["model"].state_dict().items()}  # under the LoraLayers
    config = transformers.LlamaConfig(**load_config("tiny-llama"))

    def model(adapter):
        m = transformers.LlamaForCausalLM(config).eval()
        m.load_state_dict(base)
        return m if adapter is None else peft.PeftModel.from_pretrained(m, tmp_path / "demo-adapters" / adapter)

    prompts = ns["prompts"].cpu()
    with torch.no_grad():
        for rid, adapter in enumerate(["sql-expert", None, "support-bot", "sql-expert"]):
            want = model(adapter)(prompts[rid : rid + 1]).logits[0]
            got = ns["logits"][rid].float().cpu()
            # a bfloat16 store: rounding of 1e-2 at most, against an adapter that moves logits by about 1
            torch.testing.assert_close(got, want, rtol=0, atol=2e-2, msg=f"request {rid} ({adapter})")
            if adapter is not None:
                assert (want - model(None)(prompts[rid : rid + 1]).logits[0]).abs().max() > 0.5


def test_the_readme_cites_only_files_the_project_has():
    root = README.parent
    modules = root / "src/mstar/engine/resources/lora"
    cited = set(re.findall(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|sh))\b", README.read_text()))
    missing = [c for c in cited if not any((where / c).exists() for where in (root, modules, modules / "tools",
                                                                                   modules / "models"))]
    assert len(cited) > 30 and not missing, f"the README cites {missing}"
