"""mstar-lora inspect / check: the startup gate's exit status (0 only when every adapter named was checked
and can be served, 1 when one cannot be, 2 when the command is wrong), its --json, and its tables."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from diffusion import WAN, native, save_wan_lora
from safetensors.torch import load_file, save_file
from tiny import make_adapter, model_config, write_config

from mstar.engine.resources.lora import LoraManager, check_adapter_file, specs_from_config
from mstar.engine.resources.lora.tools.cli import main


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A good adapter (rank 4) and one over --max-rank 8 (rank 16), made by PEFT once for the module."""
    tmp = tmp_path_factory.mktemp("made")
    return {"good": make_adapter(tmp, name="good")[1], "big": make_adapter(tmp, name="big", r=16)[1],
            "config": write_config(tmp, model_config("llama"))}


def copy(made, which: str, to):
    to.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(made[which], to)
    return to


def check(*args: str) -> int:
    return main(["check", *map(str, args)])


def test_check_names_every_bad_adapter_and_exits_1(made, capsys):
    assert check(made["config"], made["good"], f"huge={made['big']}", "--max-rank", "8") == 1
    out, err = capsys.readouterr()
    assert "good" in out and "ok" in out and "refused" in out
    assert "1 of 2 adapters cannot be served" in err and "adapter 'huge'" in err and "rank 16" in err


def test_one_adapter_refused_reads_as_its_refusal_not_1_of_1(made, capsys):
    assert check(made["config"], made["big"], "--max-rank", "8") == 1
    err = capsys.readouterr().err
    assert "of 1 adapters" not in err and err.strip().startswith("adapter 'big'")


def test_adapters_of_one_default_name_are_refused_not_one_dropped(made, tmp_path, capsys):
    a = copy(made, "big", tmp_path / "a" / "adapter")
    b = copy(made, "good", tmp_path / "b" / "adapter")
    assert check(made["config"], a, b, "--max-rank", "8") == 2, "a/adapter would go unchecked"
    err = capsys.readouterr().err
    assert "two adapters are named 'adapter'" in err and str(a) in err and str(b) in err
    assert check(made["config"], f"a={a}", f"b={b}", "--max-rank", "8") == 1, "named apart, both are checked"


def test_a_serving_entry_never_replaces_an_adapter_given_by_name(made, tmp_path, capsys):
    serving = tmp_path / "serving.json"
    serving.write_text(json.dumps({"adapters": {"x": str(made["good"])}}))
    assert check(made["config"], f"x={made['big']}", "--serving", serving, "--max-rank", "8") == 2
    assert f"two adapters are named 'x': {made['big']} from the command line and {made['good']} from {serving}" \
        in capsys.readouterr().err


def test_a_serving_file_naming_one_adapter_twice_is_refused(made, tmp_path, capsys):
    serving = tmp_path / "serving.json"
    serving.write_text(f'{{"x": "{made["big"]}", "x": "{made["good"]}"}}')  # JSON keeps the last silently
    assert check(made["config"], "--serving", serving, "--max-rank", "8") == 2
    assert "'x' appears twice" in capsys.readouterr().err


def test_a_path_with_an_equals_sign_is_a_path(made, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    copy(made, "good", tmp_path / "lr=1e-4")  # as a training sweep names its folders
    assert check(made["config"], "lr=1e-4", "mine=lr=1e-4", "--json", "--max-rank", "16") == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["adapter"], r["path"]) for r in rows] == [("lr=1e-4", "lr=1e-4"), ("mine", "lr=1e-4")]
    assert check(made["config"], "=lr=1e-4", "--max-rank", "16") == 2
    assert "needs both a name and a path" in capsys.readouterr().err


def test_options_may_come_before_the_adapters(made, capsys):
    assert check(made["config"], "--max-rank", "16", made["good"]) == 0
    assert main(["inspect", str(made["config"]), "--max-rank", "16", str(made["good"])]) == 0


def test_a_model_folder_is_read_by_its_config_json(made, tmp_path, capsys):
    import transformers

    transformers.AutoConfig.for_model(**model_config("llama")).save_pretrained(tmp_path / "model")
    assert check(tmp_path / "model", made["good"], "--max-rank", "16") == 0
    (tmp_path / "empty").mkdir()
    assert check(tmp_path / "empty", made["good"], "--max-rank", "16") == 2
    err = capsys.readouterr().err
    assert "model folder" in err and "no config.json" in err and "Traceback" not in err


def _exits(args: list[str]) -> int:
    try:
        return main(args)
    except SystemExit as e:
        return int(e.code)


WRONG = {
    "a misspelled preset": ["check", "tiny-lama", "{good}", "--max-rank", "16"],
    "--max-rank 0": ["check", "tiny-llama", "{good}", "--max-rank", "0"],
    "--max-expert-rank 0": ["check", "qwen3-30b-a3b", "{good}", "--max-expert-rank", "0", "--max-rank", "16"],
    "--max-expert-rank -1": ["check", "qwen3-30b-a3b", "{good}", "--max-expert-rank", "-1", "--max-rank", "16"],
    "a missing --serving file": ["check", "tiny-llama", "--serving", "{tmp}/missing.json", "--max-rank", "16"],
    "a --serving list": ["check", "tiny-llama", "--serving", "{tmp}/list.json", "--max-rank", "16"],
    "a deeply nested --serving file": ["check", "tiny-llama", "--serving", "{tmp}/deep.json", "--max-rank", "16"],
    "a deeply nested model config": ["check", "{tmp}/deep.json", "{good}", "--max-rank", "16"],
    "a model config of a string": ["check", "{tmp}/list.json", "{good}", "--max-rank", "16"],
    "no adapters": ["check", "tiny-llama", "--max-rank", "16"],
    "check without --max-rank": ["check", "tiny-llama", "{good}"],
    "an unknown --dtype": ["check", "tiny-llama", "{good}", "--max-rank", "16", "--dtype", "fp8"],
}


@pytest.mark.parametrize("what", WRONG)
def test_a_wrong_command_exits_2(made, tmp_path, capsys, what):
    (tmp_path / "list.json").write_text(json.dumps(["a", "b"]))
    (tmp_path / "deep.json").write_text("[" * 100_000)
    args = [a.format(good=made["good"], tmp=tmp_path) for a in WRONG[what]]
    assert _exits(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error" in err


def test_an_adapter_that_cannot_be_served_exits_1(made, capsys):
    assert _exits(["check", str(made["config"]), str(made["big"]), "--max-rank", "8"]) == 1
    long = "a" * 300  # past NAME_MAX: an OSError inside, still this adapter's refusal
    assert _exits(["check", str(made["config"]), long, str(made["good"]), "--max-rank", "16"]) == 1
    err = capsys.readouterr().err
    assert f"adapter '{long}' ({long}): " in err and "Traceback" not in err


def test_help_says_what_the_exit_codes_mean(capsys):
    assert _exits(["check", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "0 every adapter named was checked and can be served" in out and "2 the command is wrong" in out
    for args in (["--help"], ["check", "--help"]):
        assert _exits(args) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "--max-rank or --max-expert-rank that is not a positive integer" in out, args
        assert "check without --max-rank" in out, args


def test_check_gives_host_bytes_at_the_dtype_asked_and_says_it(made, capsys):
    from mstar.engine.resources.lora.checkpoint import open_checkpoint
    from mstar.engine.resources.lora.layout import SlotLayout
    from mstar.engine.resources.lora.plan import host_bytes

    spec = specs_from_config(made["config"], max_rank=16)["language_model"]
    with open_checkpoint(made["good"]) as ckpt:
        want = {d: host_bytes(ckpt, SlotLayout(spec, dtype=getattr(torch, d))) for d in ("bfloat16", "float32")}
    assert want["float32"] == 2 * want["bfloat16"]
    for dtype, extra in (("bfloat16", []), ("float32", ["--dtype", "float32"])):
        assert check(made["config"], made["good"], "--max-rank", "16", "--json", *extra) == 0
        assert json.loads(capsys.readouterr().out)[0]["host_bytes"] == want[dtype]
        assert check(made["config"], made["good"], "--max-rank", "16", *extra) == 0
        assert f"at max_rank 16, {dtype} ({want[dtype]} bytes" in capsys.readouterr().out


def test_help_and_argument_errors_import_no_torch():
    code = ("import sys\nfrom mstar.engine.resources.lora.tools.cli import main\n"
            "for args in (['--help'], ['check', '--help'], ['check', 'tiny-llama', 'x', '--max-rank', '0'],"
            " ['check', 'no-such-preset']):\n"
            "    try:\n        main(args)\n    except SystemExit:\n        pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_json_gives_the_whole_digest_and_numbers_as_numbers(made, capsys):
    config, good, big = made["config"], made["good"], made["big"]
    assert check(config, good, big, "--max-rank", "8", "--json") == 1
    ok, refused = json.loads(capsys.readouterr().out)
    spec = specs_from_config(config, max_rank=8)["language_model"]
    assert ok["digest"] == check_adapter_file(spec, "good", good).hex(), "as check_adapter_file gives it"
    manager = LoraManager.build(config, max_rank=8, host_capacity=2, slots=2)
    assert ok["digest"] == manager.register("good", good).digest.hex(), "as a manager's step.digest gives it"
    assert ok["rank"] == 4 and ok["scaling"] == 2.0 and ok["verdict"] == "ok" and ok["reason"] is None
    assert ok["file_bytes"] == os.path.getsize(good / "adapter_model.safetensors")
    assert isinstance(ok["host_bytes"], int) and ok["host_bytes"] > 0
    assert ok["targets"] == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert refused["verdict"] == "refused" and refused["digest"] is None and refused["rank"] == 16
    assert refused["reason"].startswith("adapter 'big' (") and "over this pool's max_rank 8" in refused["reason"]
    assert main(["inspect", str(config), str(good), str(big), "--max-rank", "8", "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)
    shared = ("adapter", "path", "verdict", "reason", "rank", "scaling", "targets", "file_bytes")
    assert [{k: r[k] for k in shared} for r in rows] == [{k: r[k] for k in shared} for r in (ok, refused)], \
        "inspect and check give one verdict and reason"


def test_inspect_json_gives_each_module_typed(made, capsys):
    assert main(["inspect", str(made["config"]), str(made["good"]), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    q = next(m for m in row["modules"] if m["module"] == "model.layers.1.self_attn.k_proj")
    assert q == {"module": "model.layers.1.self_attn.k_proj", "node": "language_model", "target": "qkv_proj",
                 "layer": 1, "slice": 1, "rank": 4, "scaling": 2.0}


def test_inspect_fits_its_rows_to_the_terminal(made, tmp_path, monkeypatch, capsys):
    notes = tmp_path / "notes.safetensors"
    notes.write_text("notes on a training run, not weights\n")
    args = ["inspect", str(made["config"]), str(made["good"]), str(made["big"]), str(notes), "--max-rank", "8"]
    monkeypatch.setenv("COLUMNS", "80")
    assert main(args) == 1
    out = capsys.readouterr().out.split("\n\n")[0]
    assert max(map(len, out.splitlines())) <= 80
    words = " ".join(out.split())
    assert "it begins with text, b'notes on'" in words and "over this pool's max_rank 8" in words, "wrapped, not cut"
    monkeypatch.delenv("COLUMNS")
    assert main(args) == 1
    out = capsys.readouterr().out.split("\n\n")[0]
    assert len(out.splitlines()) == 4, "into a pipe, one line a row"
    assert not any(line.endswith(" ") for line in out.splitlines()), "no padding after the last column"


def test_a_fifo_as_model_or_serving_file_is_refused_at_once(made, tmp_path, capsys):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    codes = []
    for args in (["check", str(fifo), str(made["good"]), "--max-rank", "16"],
                 ["check", "tiny-llama", "--serving", str(fifo), "--max-rank", "16"]):
        t = threading.Thread(target=lambda a=args: codes.append(_exits(a)), daemon=True)
        t.start()
        t.join(30)
        if t.is_alive():  # let the blocked reader go before failing
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            pytest.fail(f"{args} blocked on a FIFO")
    assert codes == [2, 2]
    assert capsys.readouterr().err.count("not a regular file") == 2


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


def test_a_refused_row_shows_dashes_and_a_truncated_files_size(made, tmp_path, capsys):
    cut = copy(made, "good", tmp_path / "cut")
    weights = cut / "adapter_model.safetensors"
    os.truncate(weights, os.path.getsize(weights) // 2)
    assert check(made["config"], made["good"], cut, made["big"], "--max-rank", "8", "--json") == 1
    rows = json.loads(capsys.readouterr().out)
    assert rows[1]["verdict"] == "refused" and rows[1]["file_bytes"] == os.path.getsize(weights), "it is there"
    assert check(made["config"], made["good"], cut, made["big"], tmp_path / "none", "--max-rank", "8") == 1
    table_rows = capsys.readouterr().out.split("\n\n")[0].splitlines()[1:]
    assert "None" not in " ".join(table_rows)
    for row in table_rows[1:3]:  # cut, big: refused, so neither host bytes nor a digest
        assert row.split()[-2:-1] == ["-"] and row.split().count("-") >= 2, row


def test_check_and_inspect_import_no_torch(made, tmp_path, capsys):
    """The startup gate runs at every start of every rank: it reads headers and config files and hashes bytes,
    none of which needs torch, whose import was most of a check's seconds. Each command runs in a fresh
    interpreter, and says what it says in this one (where torch is loaded)."""
    wan = write_config(tmp_path, WAN)
    kohya = native(save_wan_lora(tmp_path / "d"), tmp_path / "kohya.safetensors", "kohya")  # alphas, read alone
    tensors = load_file(kohya)
    tensors["lora_unet_blocks_1_ffn_2.alpha"] = torch.tensor(12, dtype=torch.int64)  # as some trainers store it
    save_file(tensors, kohya)
    config, good, big = (str(made[k]) for k in ("config", "good", "big"))
    code = ("import sys\nfrom mstar.engine.resources.lora.tools.cli import main\ncode = main(sys.argv[1:])\n"
            "assert 'torch' not in sys.modules, 'torch imported'\nsys.exit(code)\n")
    for args, status in ((["check", config, good, big, "--max-rank", "8", "--json"], 1),
                         (["inspect", config, good, "--json"], 0),
                         (["check", str(wan), str(kohya), "--max-rank", "8", "--json", "--dtype", "float32"], 0),
                         (["inspect", str(wan), str(kohya), "--max-rank", "8", "--json"], 0),
                         (["check", "qwen3-30b-a3b", good, "--max-rank", "8", "--json"], 1)):
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == status, done.stderr
        assert main(args) == status
        assert json.loads(done.stdout) == json.loads(capsys.readouterr().out), args
