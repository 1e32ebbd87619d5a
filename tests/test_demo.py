"""The main job: mstar-lora demo serves its trace through the manager and checks every token against PEFT."""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile

import peft
import pytest
import torch

from mstar.engine.resources.lora import LoraManager, Request
from mstar.engine.resources.lora.models import presets
from mstar.engine.resources.lora.pool import LoraDevicePool
from mstar.engine.resources.lora.tools import demo, engine
from mstar.engine.resources.lora.tools.cli import main, parsers
from mstar.engine.resources.lora.tools.demo_models import REFUSED, demo_config, runnable
from mstar.engine.resources.lora.tools.hf import TokenSlots, attach


@pytest.fixture
def tmpdir_of_its_own(tmp_path, monkeypatch):
    """tempfile's folder for this test alone, to see what the demo leaves there."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def peft_table(out: str) -> list[list[str]]:
    """The rows of the demo's closing table, split on runs of spaces."""
    rows = out.split("checking every request against PEFT")[1].split("closest call")[0].strip().splitlines()[2:]
    return [re.split(r"\s{2,}", r.strip()) for r in rows]


def test_the_demo_serves_its_trace_and_every_token_matches_peft(tmpdir_of_its_own, capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("every request's tokens match PEFT generating with its adapter version")
    assert re.search(r"startup check: [^\n]*\n?adapter 'too-big' \(.*\): module .*: rank 32, over this pool's "
                     r"max_rank 16", out)
    rows = peft_table(out)
    for adapter, version, _, tokens, same, differ in rows:
        assert same == tokens, f"{adapter} {version}"
        assert adapter == "(base model)" or int(differ) > 0, f"{adapter}'s adapter changed none of its tokens"
    versions = [(r[0], r[1]) for r in rows if r[0] == "support-bot"]
    assert len(versions) == 2 and versions[0][1] != versions[1][1], "both sides of the reload were checked"
    french = [j for j in demo.trace_jobs(256) if j.adapter == demo.BROKEN]
    after = [j.id for j in french if j.arrives > demo.BREAK_AT]
    failures = re.findall(r"\nfailed ((?:r\d+ ?)+): adapter 'french' \(.*/french/adapter_model.safetensors\): bad "
                          r"safetensors file", out)
    failed = " ".join(failures).split()
    assert len(failures) == 1 and set(after) <= set(failed) <= {j.id for j in french}, \
        "the broken adapter's requests since its file broke fail, naming it, and no other request fails"
    requests = sum(len(arrivals) for arrivals in demo.TRACE.values())
    assert sum(len(r[2].split()) for r in rows) == requests - len(failed), "every other request ran and was checked"
    reads, read_failures, evictions, hits = map(int, re.search(
        r"(\d+) reads \(.*, (\d+) failed\), (\d+) evictions, \d+ slot copies, host hits (\d+)", out).groups())
    assert reads > demo.HOST_CAPACITY and read_failures == 1 and evictions > 0 and hits > 0
    assert len(re.findall(r"\n +\d+  ", out)) > max(demo.TRACE), "a line a step"
    assert os.listdir(tmpdir_of_its_own) == [], "no temporary folder is left behind"


def test_a_wrong_delta_fails_the_demo_naming_the_request(tmp_path, capsys, monkeypatch):
    activate = LoraDevicePool.activate

    def wrong_scaling(self, adapter, keep=()):  # a pool bug: rslora's slot scaled by sqrt(r) twice
        slot = activate(self, adapter, keep)
        if adapter.name.startswith("rslora@"):
            self.scaling[slot] = adapter.scaling / 12**0.5
        return slot

    monkeypatch.setattr(LoraDevicePool, "activate", wrong_scaling)
    assert main(["demo", "--keep", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"MISMATCH r5 \(rslora\): ran \[.*\], PEFT generates \[", out)
    assert out.rstrip().endswith("MISMATCH: see above")
    assert (tmp_path / "sql-expert" / "adapter_config.json").is_file(), "--keep keeps the adapters"


@pytest.mark.parametrize("how", ["Ctrl-C", "an error", "SIGTERM"])
def test_an_interrupted_demo_leaves_no_temporary_folder(tmpdir_of_its_own, monkeypatch, how):
    forward, calls = engine.Engine.forward, []

    def interrupted(self, step, running):
        calls.append(1)
        if len(calls) == 3:
            if how == "Ctrl-C":
                raise KeyboardInterrupt
            if how == "an error":
                raise RuntimeError("the device fell over")
            os.kill(os.getpid(), signal.SIGTERM)
        return forward(self, step, running)

    monkeypatch.setattr(engine.Engine, "forward", interrupted)
    before = signal.getsignal(signal.SIGTERM)
    if how == "Ctrl-C":
        assert main(["demo"]) == 130
    else:
        with pytest.raises(RuntimeError if how == "an error" else SystemExit):
            main(["demo"])
    assert os.listdir(tmpdir_of_its_own) == []
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("model", [p for p in presets() if p not in runnable()] + ["bert", "missing"])
def test_a_model_the_demo_does_not_run_is_refused_in_one_line(tmp_path, capsys, model):
    if model == "bert":
        model = str(tmp_path / "config.json")
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    elif model == "missing":
        model = str(tmp_path / "nowhere.json")
    assert main(["demo", "--model", model]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"mstar-lora demo: --model {model}")


def test_help_names_every_preset_as_run_or_refused(capsys):
    with pytest.raises(SystemExit):
        parsers()[0].parse_args(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    ran, refused = text.split("refused, exit 2:")
    assert set(runnable()) | {p for p in presets() if f"{p} (" in refused} == set(presets())
    assert all(p in ran for p in runnable()) and not set(runnable()) & set(REFUSED)
    assert {"phi-3-mini", "qwen3-30b-a3b", "gpt-oss-20b", "llama-3.1-8b"} <= set(runnable())


@pytest.mark.parametrize("preset", runnable())
def test_every_preset_the_demo_runs_serves_its_samples_as_peft_does(tmp_path, preset):
    """What differs between presets (the config shrunk, the model class, the modules the samples name,
    the experts node) through the manager, against PEFT loading the same folder."""
    raw, _ = demo_config(preset)
    m = LoraManager.build(raw, max_rank=demo.MAX_RANK, host_capacity=4, slots=3, dtype=torch.float32)
    paths = demo.write_samples(m.stores["language_model"].spec, tmp_path)
    m.register_all({n: paths[n] for n in ("sql-expert", "patterned")})
    waiting = [Request(0, "sql-expert"), Request(1, "patterned"), Request(2, None)]
    m.step([], waiting)
    m.wait_for_reads()
    step = m.step([], waiting)
    make = demo.base_factory(raw, torch.device("cpu"))
    model, slots = make(), TokenSlots()
    attach(model, m.pools, slots)
    ids = torch.randint(1, raw["vocab_size"], (3, 6), generator=torch.Generator().manual_seed(0))
    slots.rows = torch.tensor([step.slot[i] for i in range(3)])
    with torch.no_grad():
        got, plain = model(ids).logits, make()(ids).logits
        torch.testing.assert_close(got[2], plain[2], rtol=1e-4, atol=1e-4, msg=f"{preset}: the base model's row")
        for row, name in enumerate(["sql-expert", "patterned"]):
            want = peft.PeftModel.from_pretrained(make(), paths[name])(ids[row : row + 1]).logits[0]
            torch.testing.assert_close(got[row], want, rtol=1e-4, atol=1e-4, msg=f"{preset} {name}")
            assert (want - plain[row]).abs().max() > 0.1, "the adapter matters"
    m.close()
