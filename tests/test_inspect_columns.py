"""The inspection in passes over columns (inspect_columns.py): where it answers, its answer is the walk's, module
by module; a header of thousands of modules of a few templates wrong in one of them is refused naming that one,
as the walk names it (tests/test_compiled_equal.py compares the same files' refusals with the code before)."""

from __future__ import annotations

import json
import re
from operator import attrgetter

import pytest
import torch
from moe import CONFIGS, INTER, MANY, ODD, many_experts_variants, specs, stacked_adapter
from safetensors.torch import load_file, save_file
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import check_adapter_file, specs_from_config
from mstar.engine.resources.lora.check import _VOCAB_MODULES, _walk, check_adapter_tensors, misfit_at
from mstar.engine.resources.lora.checkpoint import open_checkpoint
from mstar.engine.resources.lora.experts import checkpoint_orientations
from mstar.engine.resources.lora.inspect_columns import plain_header, plain_info, plain_pairs
from mstar.engine.resources.lora.keys import group_keys, peft_keys


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    return many_experts_variants(tmp_path_factory.mktemp("many"))


def _nodes():
    s = specs("qwen3_moe", **MANY)
    return [s["language_model"], s["experts"]]


def _columns(spec, ckpt):
    """The column pass's answer for ckpt (None where it leaves the header to the walk), and the walk's."""
    modules = ckpt.modules(spec.convert_keys)
    pairs = plain_pairs(modules, _VOCAB_MODULES)
    # taken from group_keys' columns (keys.Grouped.ab) where it found them, or from every module's roles: alike
    assert pairs == plain_pairs(dict(modules), _VOCAB_MODULES)
    plain = plain_info(spec, pairs, attrgetter("shape"), misfit_at)
    walked = _walk(spec, modules, attrgetter("shape"), ckpt.config)
    if plain is None:
        return None, walked
    rules = ckpt.module_rules(spec.convert_keys)
    ok = plain_header(spec, plain, ckpt.config, rules, checkpoint_orientations(spec, ckpt))
    return (plain.info if ok else None), walked


def test_a_plain_header_is_judged_in_columns_as_the_walk_judges_it(variants):
    path = variants["plain"][0]
    nodes = _nodes()
    assert check_adapter_file(nodes[0], "plain", path, nodes[1:])
    with open_checkpoint(path) as ckpt:
        for spec in nodes:
            info, walked = _columns(spec, ckpt)
            assert info == walked and not walked.misfits
        assert _columns(nodes[1], ckpt)[0].rank == 2 and len(_columns(nodes[0], ckpt)[0].unmapped) == 32 * 128 * 3


@pytest.mark.parametrize("name", ["wrong-shape", "over-rank", "config-rank", "dtype", "doubled", "lacking",
                                  "unpaired", "past", "layer-past", "lm-head"])
def test_one_module_wrong_among_thousands_is_refused_naming_it(variants, name):
    path, module, words = variants[name]
    nodes = _nodes()
    with pytest.raises(ValueError) as e:
        check_adapter_file(nodes[0], name, path, nodes[1:])
    message = str(e.value)
    assert message.startswith(f"adapter {name!r} ({path / 'adapter_model.safetensors'}):")
    assert f"module {module}: {words}" in message or (f"module {module}: " in message and words in message)
    assert "more module" not in message and message.count("module ") <= 2
    with open_checkpoint(path) as ckpt:
        answers = [_columns(spec, ckpt) for spec in nodes]
    assert any(info is None for info, _ in answers), "the column pass let a wrong module through"
    assert all(info == walked for info, walked in answers if info is not None)


def test_a_module_pushed_under_two_spellings_each_a_pair_is_refused(variants):
    """Pushed tensors come in any order: one module's two pairs of keys, far apart, are still two keys for each
    of its weights."""
    path = variants["plain"][0]
    tensors = load_file(path / "adapter_model.safetensors")
    key = f"base_model.model.{ODD}.down_proj"
    pushed = {f"{key}.lora_A.default.weight": tensors[f"{key}.lora_A.weight"].clone(),
              f"{key}.lora_B.default.weight": tensors[f"{key}.lora_B.weight"].clone(), **tensors}
    config = json.loads((path / "adapter_config.json").read_text())
    nodes = _nodes()
    with pytest.raises(ValueError, match=rf"'twice' \(<pushed tensors>\): module {re.escape(ODD)}\.down_proj: two keys "
                                         "read as its A"):
        check_adapter_tensors(nodes[0], "twice", pushed, config, nodes[1:])
    assert check_adapter_tensors(nodes[0], "once", tensors, config, nodes[1:])


def test_a_stacked_module_and_one_of_its_experts_are_refused_as_filling_the_same_weights(tmp_path):
    """A module covering every slice of its target (PEFT's stacked gate_up) beside one covering one of them
    (expert 0's gate, as transformers 4 named it), both targeted by the config: neither is guessed."""
    _, path = stacked_adapter(tmp_path, "qwen3_moe", name="both")
    file, config_file = path / "adapter_model.safetensors", path / "adapter_config.json"
    tensors = load_file(file)
    key, hidden = "base_model.model.model.layers.0.mlp.experts.0.gate_proj", CONFIGS["qwen3_moe"]["hidden_size"]
    tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = torch.zeros(2, hidden), torch.zeros(INTER, 2)
    save_file(tensors, file)
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "target_modules": [*config["target_modules"], "gate_proj"]}))
    s = specs("qwen3_moe")
    with pytest.raises(ValueError, match=r"module model\.layers\.0\.mlp\.experts\.\S+: fills the same weights as"):
        check_adapter_file(s["language_model"], "both", path, [s["experts"]])


@pytest.mark.parametrize("pattern", [{"down_proj": 2, "k_proj": 8}, {"q_proj": 6}])
def test_an_adapter_of_mixed_ranks_is_told_by_its_largest(tmp_path, pattern):
    _, path = make_adapter(tmp_path, rank_pattern=pattern)
    spec = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
    with open_checkpoint(path) as ckpt:
        info, walked = _columns(spec, ckpt)
    assert info == walked and info.rank == max(4, *pattern.values())


def test_a_module_saved_under_two_spellings_each_a_pair_is_refused(variants, tmp_path):
    """PEFT's lora_A / lora_B and kohya's lora_down / lora_up of one module sort A, B, A, B in its file: two pairs
    of one module, still two keys for each of its weights."""
    path = variants["plain"][0]
    tensors = load_file(path / "adapter_model.safetensors")
    key = f"base_model.model.{ODD}.down_proj"
    tensors[f"{key}.lora_down.weight"] = tensors[f"{key}.lora_A.weight"].clone()
    tensors[f"{key}.lora_up.weight"] = tensors[f"{key}.lora_B.weight"].clone()
    (tmp_path / "spelled").mkdir()
    save_file(tensors, tmp_path / "spelled" / "adapter_model.safetensors")
    (tmp_path / "spelled" / "adapter_config.json").write_text((path / "adapter_config.json").read_text())
    with open_checkpoint(tmp_path / "spelled") as ckpt:  # the order the keys are grouped in
        assert [k.rsplit(".", 2)[-2] for k in ckpt.header.tensors if k.startswith(f"{key}.")] == [
            "lora_A", "lora_B", "lora_down", "lora_up"]
    nodes = _nodes()
    with pytest.raises(ValueError, match=rf"module {re.escape(ODD)}\.down_proj: two keys read as its A"):
        check_adapter_file(nodes[0], "spelled", tmp_path / "spelled", nodes[1:])


@pytest.mark.parametrize(("keys", "ab"), [
    (["m.lora_A.weight", "m.lora_B.weight", "n.lora_A.weight", "n.lora_B.weight"], (["m", "n"], [0, 2], [1, 3])),
    (["m.lora_B.weight", "m.lora_A.weight"], None),  # a B listed first: grouped, but not taken by slicing
    (["m.alpha", "m.lora_A.weight"], None),  # two by two, but an alpha and an A
    (["m.lora_A.weight", "m.lora_A.default.weight"], None),  # one role twice: no pairs at all
])
def test_group_keys_takes_columns_only_where_every_module_is_an_a_then_a_b(keys, ab):
    grouped = group_keys({k: i for i, k in enumerate(keys)}, peft_keys)
    assert getattr(grouped, "ab", None) == ab
    assert (plain_pairs(grouped, _VOCAB_MODULES) is None) == (plain_pairs(dict(grouped), _VOCAB_MODULES) is None)
