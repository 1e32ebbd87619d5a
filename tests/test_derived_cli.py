"""mstar-lora on a model folder of an architecture no builder here knows: inspect with no adapter shows the
targets derived (name, layers, widths, sharding), and check serves PEFT's own adapter for it."""

from __future__ import annotations

import json

import pytest
from derived import all_linear_adapter, build, tiny_config

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.tools.cli import main
from mstar.engine.resources.lora.tools.targets import target_rows


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A DeepSeek-V3 model folder as save_pretrained writes it (a dense first layer, MoE after), and an adapter."""
    tmp = tmp_path_factory.mktemp("dsv3")
    config = tiny_config("deepseek_v3")
    config.save_pretrained(tmp / "model")
    return tmp / "model", all_linear_adapter(tmp, build(config))[1]


def test_inspect_a_model_folder_alone_lists_the_targets_derived(folder, capsys):
    model, _ = folder
    assert main(["inspect", str(model), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == json.loads(json.dumps(target_rows(specs_from_config(model, max_rank=64))))
    by_name = {r["target"]: r for r in rows}
    assert by_name["model.layers.*.mlp.gate_proj+up_proj"]["layers"] == [0]
    assert by_name["model.layers.*.mlp.experts.gate_up_proj"]["layers"] == [1, 2, 3]
    assert by_name["model.layers.*.mlp.experts.gate_up_proj"]["experts"]["count"] == 4
    assert main(["inspect", str(model)]) == 0
    table = capsys.readouterr().out
    assert "model.layers.*.mlp.experts.down_proj" in table and "3: 1-3" in table and "4 experts x 32" in table


def test_check_serves_peft_all_linear_on_a_derived_architecture(folder, capsys):
    model, adapter = folder
    assert main(["check", str(model), str(adapter), "--max-rank", "4"]) == 0
    assert "ok" in capsys.readouterr().out


def test_help_names_any_architecture_transformers_can_build(capsys):
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "any architecture transformers can build" in out and "with none, the targets the model serves" in out
