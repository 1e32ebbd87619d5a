"""Configs, headers, paths and pushed values as a hostile or broken party writes them: a ValueError naming
adapter, file and reason, in bounded time and memory; never another exception, a hang or a crash."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft.utils import get_peft_model_state_dict
from reference import lora_modules, module_input, peft_delta, slot_delta
from safetensors.torch import save_file
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file, specs_from_config
from mstar.engine.resources.lora import safetensors_header as sh
from mstar.engine.resources.lora.check import check_adapter_tensors
from mstar.engine.resources.lora.patterns import Matching, fullmatch, peft_match

LM = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
TESTS = Path(__file__).parent


def assert_matches_peft(pm, path):
    digest = check_adapter_file(LM, "ad", path)
    adapter = LoraAdapterStore(LM, pin=False, dtype=torch.float32).read("ad", path, digest)
    g = torch.Generator().manual_seed(0)
    for module, layer in lora_modules(pm).items():
        x = module_input(layer, 3, g)
        torch.testing.assert_close(slot_delta(adapter.a, adapter.b, adapter.scaling, LM, module, x),
                                   peft_delta(layer, x), rtol=1e-5, atol=1e-6, msg=module)


def test_a_pattern_that_backtracks_exponentially_is_matched_in_bounded_time():
    """(.|.)*# takes re about 2^n steps on a name of n characters that has no #; the check runs in a child
    with a time limit, so that a regression fails the test instead of hanging the suite."""
    code = f"""
import sys, json, tempfile, pathlib
sys.path.insert(0, {str(TESTS)!r})
from tiny import make_adapter
from test_hostile_configs import LM
from mstar.engine.resources.lora import check_adapter_file
tmp = pathlib.Path(tempfile.mkdtemp())
_, path = make_adapter(tmp)  # PEFT itself would take as long to match these: they are written in afterwards
config = json.loads((path / "adapter_config.json").read_text())
config["rank_pattern"] = {{"(.|.)*#": 8, "(a|aa)*b": 8, "(x+x+)+y": 8}}
(path / "adapter_config.json").write_text(json.dumps(config))
print(check_adapter_file(LM, "ad", path).hex())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and len(done.stdout.split()[-1]) == 64, done.stderr[-2000:]


def test_patterns_that_repeat_match_as_re_does_and_peft_serves_them(tmp_path):
    pm, path = make_adapter(tmp_path, r=4, rank_pattern={r"layers\.[12]\..*k_proj": 2, "(q|v)_pro+j": 6},
                            alpha_pattern={r".*\.mlp\..*": 24, "o_proj": 3})
    assert_matches_peft(pm, path)


@pytest.mark.parametrize("key", [r"(.*\.)*q_proj", r"(a|b|\w)+_proj", r"layers\.\d+\.mlp\.(up|down)_proj", r"x?y*",
                                 r"(self|cross)_attn\.[qkv]_proj$", r"\bq_proj", r"[^.]+\.q_proj", "a)|(b", ""])
def test_every_kind_of_pattern_answers_as_re_does(key):
    names = ["model.layers.0.self_attn.q_proj", "model.layers.12.mlp.down_proj", "q_proj", "a.b", "x\n",
             "model.layers.1.cross_attn.v_proj", "_proj", "self_attn.k_proj\n"]
    for name in names:
        assert peft_match(key, name) == bool(re.match(rf"(.*\.)?({key})$", name)), (key, name)
        try:
            want = bool(re.fullmatch(key, name))
        except re.error:
            continue
        assert fullmatch(key, name) == want, (key, name)


def test_the_first_key_that_matches_wins_as_in_peft():
    keys = ["layers.1.self_attn.q_proj", "q_proj", r"layers\.1\..*", "self_attn.q.proj", "mlp.down_proj"]
    for name, want in [("model.layers.1.self_attn.q_proj", 0), ("model.layers.2.self_attn.q_proj", 1),
                       ("model.layers.1.mlp.down_proj", 2), ("model.layers.3.self_attn.q_proj", 1),
                       ("model.layers.3.mlp.down_proj", 4), ("model.layers.3.mlp.up_proj", None)]:
        naive = next((i for i, k in enumerate(keys) if re.match(rf"(.*\.)?({k})$", name)), None)
        assert Matching([name]).keys(keys, "rank_pattern").first(name) == naive == want, name


@pytest.mark.parametrize(("pattern", "why"), [("(?i:q)_pro+j", "sets flags"), ("(?i)q_proj", "not a valid pattern"),
                                              ("x" * 2000, "over 1024"), ("(", "not a valid pattern"),
                                              ("(a)(?(1)b|c)*", "not matched here")])
def test_a_pattern_that_cannot_be_matched_in_bounded_time_is_refused_by_name(tmp_path, pattern, why):
    _, path = make_adapter(tmp_path)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "rank_pattern": {pattern: 4}}))
    with pytest.raises(ValueError, match=rf"adapter 'ad' \(.*adapter_config.json\): rank_pattern key .*{why}"):
        check_adapter_file(LM, "ad", path)


def test_lora_alpha_zero_with_an_alpha_pattern_serves_what_peft_does(tmp_path):
    pm, path = make_adapter(tmp_path, r=4, lora_alpha=0, alpha_pattern={"q_proj": 8, "down_proj": 2})
    assert_matches_peft(pm, path)


def test_deep_json_in_a_files_metadata_is_refused(tmp_path):
    file = tmp_path / "deep.safetensors"
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 8)}, file,
              metadata={"lora_adapter_metadata": "[" * 100_000 + "]" * 100_000})
    from diffusion import WAN

    spec = specs_from_config(WAN, max_rank=8)["transformer"]
    with pytest.raises(ValueError, match=r"adapter 'ad' \(.*deep.safetensors\): lora_adapter_metadata"):
        check_adapter_file(spec, "ad", file)


@pytest.mark.parametrize(("value", "why"), [
    (lambda t: t.to("meta"), "is a meta tensor"),
    (lambda t: t.to_sparse(), "is a torch.sparse_coo tensor; push dense ones"),
    (lambda t: t.numpy(), "is a ndarray, not a tensor"),
    (lambda t: t.to(torch.complex64), "has dtype torch.complex64"),
])
def test_pushed_values_that_are_not_plain_tensors_are_refused_by_name(tmp_path, value, why):
    pm, _ = make_adapter(tmp_path)
    tensors, config = get_peft_model_state_dict(pm), pm.peft_config["default"]
    key = sorted(tensors)[0]
    with pytest.raises(ValueError, match=rf"adapter 'ad' \(<pushed tensors>\): .*{re.escape(key)} {why}"):
        check_adapter_tensors(LM, "ad", {**tensors, key: value(tensors[key])}, config)


def test_a_pushed_key_that_is_not_a_str_is_refused_by_name(tmp_path):
    pm, _ = make_adapter(tmp_path)
    tensors, config = get_peft_model_state_dict(pm), pm.peft_config["default"]
    with pytest.raises(ValueError, match=r"adapter 'ad' \(<pushed tensors>\): key 7 is a int, not a str"):
        check_adapter_tensors(LM, "ad", {**tensors, 7: torch.zeros(1)}, config)


def test_a_path_past_name_max_is_refused(tmp_path):
    path = tmp_path / ("x" * 300) / "adapter"
    with pytest.raises(ValueError, match=r"adapter 'ad' \(.*\): cannot be opened \(File name too long\)"):
        check_adapter_file(LM, "ad", path)


def test_fifos_and_devices_in_place_of_files_are_refused_without_blocking(tmp_path):
    code = f"""
import os, sys, pathlib
sys.path.insert(0, {str(TESTS)!r})
from test_hostile_configs import LM
from mstar.engine.resources.lora import check_adapter_file
root = pathlib.Path({str(tmp_path)!r})
fifo = root / "fifo.safetensors"; os.mkfifo(fifo)
folder = root / "folder"; folder.mkdir(); os.mkfifo(folder / "adapter_model.safetensors")
(folder / "adapter_config.json").write_text('{{"peft_type": "LORA"}}')
bad = 0
for path in (fifo, folder, "/dev/zero", "/dev/null"):
    try:
        check_adapter_file(LM, "ad", path)
    except ValueError as e:
        bad += "adapter 'ad'" in str(e)
print(bad)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split()[-1] == "4", done.stdout + done.stderr[-2000:]


def header_file(path: Path, entries: int, prefix: str = "t") -> Path:
    """A safetensors file of entries empty tensors, written by hand: every entry checks, none has bytes."""
    body = ",".join(f'"{prefix}{i}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}' for i in range(entries))
    text = ("{" + body + "}").encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    return path


def test_a_header_listing_absurdly_many_tensors_is_refused_before_it_is_parsed(tmp_path):
    file = header_file(tmp_path / "many.safetensors", 1_000_000)
    with pytest.raises(ValueError, match=r"adapter 'ad' \(.*\): bad safetensors file: its header lists more than "
                                         r"262144 tensors"):
        check_adapter_file(LM, "ad", file)


def test_the_header_cache_is_bounded_in_bytes(tmp_path, monkeypatch):
    """Bounded by what it is charged (a header's bytes and what its parse holds, test_header_memory.py)."""
    sh._HEADERS.clear()
    limit = 3 * sh.held_bytes(sh.read_header(header_file(tmp_path / "one.safetensors", 4000, prefix="one_")))
    sh._HEADERS.clear()
    monkeypatch.setattr(sh._HEADERS, "limit", limit)
    for i in range(12):
        sh.read_header(header_file(tmp_path / f"h{i}.safetensors", 4000, prefix=f"h{i}_"))
        assert sh._HEADERS.nbytes <= limit
    assert len(sh._HEADERS) == 3


def test_a_name_past_the_limit_is_refused_by_the_header_check(tmp_path):
    file = tmp_path / "long.safetensors"
    save_file({"x" * 2000: torch.zeros(1)}, file)
    with pytest.raises(ValueError, match=r"bad safetensors file: tensor 'xxx.*a name of 2000 characters, over 1024"):
        check_adapter_file(LM, "ad", file)


def test_an_unreadable_config_file_is_refused_naming_it(tmp_path):
    _, path = make_adapter(tmp_path)
    config = path / "adapter_config.json"
    config.unlink()
    os.mkfifo(config)
    with pytest.raises(ValueError, match=r"adapter 'ad' \(.*adapter_config.json\)"):
        check_adapter_file(LM, "ad", path)


def test_alternatives_alone_that_backtrack_are_matched_in_bounded_time():
    """(\\w|[^#]|.) two dozen times then # has no repeat, yet re tries 3^24 ways on a name without #."""
    code = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from mstar.engine.resources.lora.patterns import check_key, fullmatch, peft_match
key = r"(\\w|[^#]|.)" * 24 + "#"
check_key(key)
print(peft_match(key, "model.layers.0.self_attn.q_proj"), fullmatch(key, "model.layers.0.self_attn.q_proj"))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["False", "False"], done.stderr[-2000:]


def test_a_config_whose_patterns_unfold_past_the_budget_is_refused(tmp_path):
    _, path = make_adapter(tmp_path)
    config = json.loads((path / "adapter_config.json").read_text())
    bombs = {f"x{i}(a|b){{900}}": 4 for i in range(40)}  # each under the limit per pattern, not together
    (path / "adapter_config.json").write_text(json.dumps({**config, "rank_pattern": bombs}))
    with pytest.raises(ValueError, match=r"rank_pattern's keys that repeat or alternate unfold to more than"):
        check_adapter_file(LM, "ad", path)


def test_a_header_whose_length_is_no_multiple_of_four_is_read_as_safetensors_reads_it(tmp_path):
    from safetensors.torch import load_file

    _, path = make_adapter(tmp_path, r=4)
    aligned = LoraAdapterStore(LM, pin=False, dtype=torch.float32).read("ad", path)
    raw = (path / "adapter_model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    text = raw[8 : 8 + n].rstrip() + b"  "  # two spaces of padding: the data starts at 2 mod 4
    assert (8 + len(text)) % 4 == 2
    (path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    assert load_file(path / "adapter_model.safetensors")
    for digest in (None, check_adapter_file(LM, "ad", path)):
        got = LoraAdapterStore(LM, pin=False, dtype=torch.float32).read("ad", path, digest)
        assert all(torch.equal(got.a[t], aligned.a[t]) and torch.equal(got.b[t], aligned.b[t]) for t in got.a)


@pytest.mark.parametrize(("path", "why"), [(None, "its path is a NoneType"), (b"/tmp/x", "its path is a bytes")])
def test_a_path_that_is_no_path_is_refused_by_name(path, why):
    with pytest.raises(ValueError, match=rf"adapter 'ad' .*{why}, not a str or os.PathLike"):
        check_adapter_file(LM, "ad", path)


def test_a_name_past_name_max_is_refused_by_inspect_too(tmp_path):
    from mstar.engine.resources.lora import inspect_adapter

    with pytest.raises(ValueError, match=r"cannot be opened \(File name too long\)"):
        inspect_adapter(LM, tmp_path / ("x" * 300))


def test_an_integer_past_pythons_digit_limit_is_refused_naming_the_config(tmp_path):
    _, path = make_adapter(tmp_path)
    text = (path / "adapter_config.json").read_text()
    (path / "adapter_config.json").write_text(text.replace('"r": 4', '"r": ' + "9" * 5000))
    with pytest.raises(ValueError, match=r"adapter_config.json\): adapter_config.json is not JSON this pool reads"):
        check_adapter_file(LM, "ad", path)


def test_an_empty_pushed_tensor_sorted_first_is_refused_not_a_crash(tmp_path):
    pm, _ = make_adapter(tmp_path)
    tensors, config = get_peft_model_state_dict(pm), pm.peft_config["default"]
    odd = {"aaa.lora_A.weight": torch.zeros(0), **tensors}
    with pytest.raises(ValueError, match=r"adapter 'ad' \(<pushed tensors>\): module aaa: no target"):
        check_adapter_tensors(LM, "ad", odd, config)
    s = LoraAdapterStore(LM, pin=False)
    with pytest.raises(ValueError, match=r"adapter 'ad' \(<pushed tensors>\)"):
        s.read_tensors("ad", odd, config, b"\0" * 32)


def test_what_a_header_derives_stays_bounded_however_many_configs_it_is_seen_with(tmp_path):
    _, path = make_adapter(tmp_path)
    config = json.loads((path / "adapter_config.json").read_text())
    for alpha in range(1, 200):
        (path / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": alpha}))
        check_adapter_file(LM, "ad", path)
    assert len(sh.read_header(path / "adapter_model.safetensors").memo) <= sh.MEMO


def test_a_pattern_whose_groups_re_would_backtrack_through_is_refused_or_matched_at_once_in_every_field():
    """An atomic group or a lookahead around a repeat backtracks in re as the repeat alone does. The states
    cannot follow an atomic group, so such a pattern is refused; a lookaround is a question at one position
    they answer, so it is matched. In a child with a time limit, as a regression would hang."""
    code = f"""
import sys, json, tempfile, pathlib
sys.path.insert(0, {str(TESTS)!r})
from tiny import make_adapter
from test_hostile_configs import LM
from mstar.engine.resources.lora import check_adapter_file
tmp = pathlib.Path(tempfile.mkdtemp())
_, path = make_adapter(tmp)
config = json.loads((path / "adapter_config.json").read_text())
for field in ({{"target_modules": "(?>(.+.+)+#)"}}, {{"rank_pattern": {{"(?>(.+.+)+#)": 4}}}},
              {{"layers_to_transform": [0], "layers_pattern": "(?>(.+.+)+#)"}}):
    (path / "adapter_config.json").write_text(json.dumps({{**config, **field}}))
    try:
        check_adapter_file(LM, "ad", path)
        print("accepted", field)
    except ValueError as e:
        assert "adapter_config.json" in str(e) and "not matched here" in str(e), e
for field in ({{"exclude_modules": "(?=(.+.+)+#)q_proj"}}, {{"alpha_pattern": {{"(?!(x+x+)+y)v_proj": 4}}}},
              {{"target_modules": "(?!(.+.+)+#).*_proj"}}):
    (path / "adapter_config.json").write_text(json.dumps({{**config, **field}}))
    print("digest", check_adapter_file(LM, "ad", path).hex())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "accepted" not in done.stdout, done.stdout + done.stderr[-2000:]
    assert done.stdout.count("digest") == 3, done.stdout + done.stderr[-2000:]


@pytest.mark.parametrize("init", ["lora_ga", "pissa_niter_4", "corda", "olora", "loftq"])
def test_an_init_that_changes_the_base_weights_is_refused(tmp_path, init):
    """PEFT's lora_ga (like PiSSA, CorDA and OLoRA) subtracts scaling * B0 A0 from the base weight when it
    initialises: served on the unchanged base, every output would be off by that much."""
    _, path = make_adapter(tmp_path)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "init_lora_weights": init}))
    with pytest.raises(ValueError, match=rf"adapter 'ad' \(.*adapter_config.json\): init_lora_weights '{init}' "
                                         "assumes modified base weights"):
        check_adapter_file(LM, "ad", path)
