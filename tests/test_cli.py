"""mstar-lora inspect / check: the table, --json, exit status naming every bad adapter."""

from __future__ import annotations

import json

import torch
from diffusion import WAN, native, save_wan_lora
from safetensors.torch import load_file, save_file
from tiny import make_adapter, model_config, write_config

from mstar.engine.resources.lora.tools.cli import main


def test_check_names_every_bad_adapter_and_exits_1(tmp_path, capsys):
    config = write_config(tmp_path, model_config("llama"))
    _, good = make_adapter(tmp_path, name="good")
    _, big = make_adapter(tmp_path, name="big", r=16)
    assert main(["check", str(config), str(good), f"huge={big}", "--max-rank", "8"]) == 1
    out, err = capsys.readouterr()
    assert "good" in out and "ok" in out and "refused" in out
    assert "1 of 2 adapters cannot be served" in err and "adapter 'huge'" in err and "rank 16" in err


def test_check_json_gives_digests(tmp_path, capsys):
    config = write_config(tmp_path, model_config("llama"))
    _, good = make_adapter(tmp_path, name="good")
    serving = tmp_path / "serving.json"
    serving.write_text(json.dumps({"adapters": {"g": str(good)}}))
    assert main(["check", str(config), "--serving", str(serving), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["adapter"] == "g" and len(rows[0]["digest"]) == 16 and rows[0]["verdict"] == "ok"


def test_a_serving_config_that_cannot_be_read_is_refused_by_name(tmp_path, capsys):
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps(["a", "b"]))
    for path, why in ((tmp_path / "missing.json", "No such file or directory"), (listed, "not a JSON list")):
        assert main(["check", "tiny-llama", "--serving", str(path)]) == 1
        err = capsys.readouterr().err
        assert f"mstar-lora: serving config {path}: " in err and why in err and "Traceback" not in err


def test_check_on_a_preset(tmp_path, capsys):
    assert main(["check", "tiny-llama"]) == 2, "no adapters named"
    assert "no adapters named" in capsys.readouterr().err


def test_inspect_a_kohya_file_prints_each_modules_scaling(tmp_path, capsys):
    config = write_config(tmp_path, WAN)
    path = native(save_wan_lora(tmp_path / "d"), tmp_path / "kohya.safetensors", "kohya")
    tensors = load_file(path)
    tensors["lora_unet_blocks_1_ffn_2.alpha"] = torch.tensor(12.0)
    save_file(tensors, path)
    assert main(["inspect", str(config), str(path), "--modules", "--max-rank", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    scaling = {line.split()[0]: line.split()[-1] for line in lines if line.startswith("blocks.")}
    assert len(scaling) == 20 and scaling["blocks.1.ffn.net.2"] == "3", "alpha 12 / rank 4"
