"""A config whose patterns cost more to match than its module names allow: refused naming the key and the
cost, in work and memory that stay bounded, with nothing of the check left behind, and the same verdict
however warm the caches (every rank must reach the same one)."""

from __future__ import annotations

import contextlib
import gc
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import check_adapter_file, inspect_adapter, specs_from_config
from mstar.engine.resources.lora.automaton import Budget, Nfa

TESTS = Path(__file__).parent
LAYERS = 40  # 280 modules: enough for the old matcher's caches to keep a third of a gigabyte
# The key: 105 characters, 4,045 states, within every limit on one pattern and a config.
COSTLY = "(?:.*){1800}(?:" + "|".join(f".*{d}.{{40}}" for d in range(10)) + ")"
PEAK_MB, KEPT_MB = 100, 16  # what README.md says checking it may take at its peak, and keep
REFUSED = (r"adapter 'ad' \(.*adapter_config\.json\): rank_pattern key '\(\?:\.\*\)\{1800\}.*'\.\.\. costs more "
           r"than the [\d,]+ steps matching this config's patterns against its module names may take")


def with_config(path: Path, **fields) -> Path:
    """The adapter at path with its config as PEFT saved it, but for fields."""
    saved = json.loads((path.parent / "saved_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**saved, **fields}))
    return path


@pytest.fixture(scope="module")
def many_modules(tmp_path_factory):
    _, path = make_adapter(tmp_path_factory.mktemp("budget"), config=model_config("llama", num_hidden_layers=LAYERS))
    (path.parent / "saved_config.json").write_text((path / "adapter_config.json").read_text())
    return specs_from_config(model_config("llama", num_hidden_layers=LAYERS), max_rank=8)["language_model"], path


def test_a_key_that_costs_gigabytes_is_refused_by_name_in_bounded_memory(many_modules, tmp_path):
    """The old matcher took this key on these names to +342 MB of RSS, kept after the check (+1.9 GB on
    1,200 of a Qwen3-30B-A3B's modules); the peak and what is kept are measured in a child, from its own
    /proc/self/status, the peak reset just before the check."""
    _, path = many_modules
    path = with_config(path, rank_pattern={COSTLY: 4})
    code = f"""
import gc, sys
sys.path.insert(0, {str(TESTS)!r})
from tiny import model_config
from mstar.engine.resources.lora import check_adapter_file, specs_from_config
spec = specs_from_config(model_config("llama", num_hidden_layers={LAYERS}), max_rank=8)["language_model"]
def status(field):
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1]) // 1024
gc.collect()
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
before = status("VmRSS")
try:
    print("accepted", check_adapter_file(spec, "ad", {str(path)!r}).hex())
except ValueError as e:
    print("refused", e)
gc.collect()
print("peak", status("VmHWM") - before, "kept", status("VmRSS") - before)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert re.match("refused " + REFUSED, lines[-2]), lines[-2]
    _, peak, _, kept = lines[-1].split()
    assert int(peak) < PEAK_MB and int(kept) < KEPT_MB, lines[-1]


def test_nothing_a_check_built_stays_alive(many_modules, tmp_path):
    spec, path = many_modules
    gc.collect()
    refused = pytest.raises(ValueError, match=REFUSED)
    for fields, checked in (({"rank_pattern": {COSTLY: 4}}, refused),
                            ({"target_modules": r"^(?!.*visual).*\.(?!\d)\w+_proj$",
                              "alpha_pattern": {r"(?<=self_attn\.)[qv]_proj": 3}}, contextlib.nullcontext())):
        with checked:
            check_adapter_file(spec, "ad", with_config(path, **fields))
        gc.collect()
        alive = [o for o in gc.get_objects() if isinstance(o, (Nfa, Budget))]
        assert not alive, fields


def test_every_rank_reaches_the_same_verdict_however_warm_its_caches(many_modules):
    """The work is counted in steps over the names of the file, each pass from empty caches: a check after an
    inspect (whose parse of the header and derivations are cached) refuses with the very words of a first."""
    spec, path = many_modules
    with_config(path, rank_pattern={"q_proj": 2, COSTLY: 4})
    refusals = []
    for warm in (False, True):
        if warm:
            with pytest.raises(ValueError):
                inspect_adapter(spec, path)
        with pytest.raises(ValueError, match=REFUSED) as e:
            check_adapter_file(spec, "ad", path)
        refusals.append(str(e.value))
    assert len(set(refusals)) == 1, refusals


def test_the_readme_states_the_bounds_measured_here():
    readme = " ".join((TESTS.parent / "README.md").read_text().split())
    assert f"peaks under {PEAK_MB} MB" in readme and f"keeps under {KEPT_MB} MB" in readme


# Keys cheap to match but, before, costly to build: a class of 1,000 literals repeated 4,000 times (each copy its
# own 1,000 tests, asked of every character: 25 s and +1 GB on 21 modules), and an empty group repeated 10^8
# times (50 s of building nothing, each time the config was read; (?:){4294967294} would be 35 minutes).
WIDE_CLASS = "[" + "".join(chr(0x4E00 + i) for i in range(1000)) + "]{4000}0"
EMPTY_REPEATS = r".*\.(?:){100000000}q_proj"


@pytest.mark.parametrize("fields", [{"rank_pattern": {WIDE_CLASS: 4}, "alpha_pattern": {WIDE_CLASS: 4}},
                                    {"target_modules": EMPTY_REPEATS}], ids=["wide-class", "empty-repeats"])
def test_keys_cheap_to_match_are_cheap_to_build(many_modules, fields):
    """Served as PEFT serves them (none of these names matches the class; the empty repeats take q_proj), in a
    child that must finish within a minute at under the README's peak: a class is one test however often the
    pattern repeats it, and a repeat of nothing is built once."""
    _, path = many_modules
    path = with_config(path, **fields)
    code = f"""
import gc, sys
sys.path.insert(0, {str(TESTS)!r})
from tiny import model_config
from mstar.engine.resources.lora import inspect_adapter, specs_from_config
spec = specs_from_config(model_config("llama", num_hidden_layers={LAYERS}), max_rank=8)["language_model"]
def status(field):
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1]) // 1024
gc.collect()
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
info = inspect_adapter(spec, {str(path)!r})
print(len(info.misfits), sum(m.endswith("q_proj") for m in info.misfits))
print("peak", status("VmHWM") - before)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    misfits, peak = done.stdout.splitlines()[-2:]
    assert int(peak.split()[1]) < PEAK_MB, peak
    # PEFT's modules: 7 a layer; target_modules taking q_proj alone leaves the other 6 of each layer out
    assert misfits == (f"{6 * LAYERS} 0" if "target_modules" in fields else "0 0"), misfits
