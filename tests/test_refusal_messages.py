"""Refusals as a new user meets them: each says what the file is, once, in plain words."""

from __future__ import annotations

import json

import peft
import pytest
from safetensors.torch import load_file, save_file
from tiny import build_model, make_adapter, model_config, write_config

from mstar.engine.resources.lora import check_adapter_file, check_adapters, specs_from_config
from mstar.engine.resources.lora.tools.cli import main


def lm_spec(**kw):
    return specs_from_config(model_config("llama"), max_rank=8, **kw)["language_model"]


def trainer_file(tmp_path, name: str, config, keep=lambda key: True):
    """A PEFT adapter's tensors under a trainer's bare module names (no base_model.model., no config beside)."""
    pm = peft.get_peft_model(build_model(model_config("llama")), config)
    pm.save_pretrained(tmp_path / f"{name}-peft")
    tensors = load_file(tmp_path / f"{name}-peft" / "adapter_model.safetensors")
    path = tmp_path / f"{name}.safetensors"
    save_file({k.removeprefix("base_model.model."): v for k, v in tensors.items() if keep(k)}, path)
    return path


def refusal(spec, path, name="ad") -> str:
    with pytest.raises(ValueError) as e:
        check_adapter_file(spec, name, path)
    return str(e.value)


def test_a_loha_file_is_refused_once_per_reason_with_no_rank(tmp_path, capsys):
    path = trainer_file(tmp_path, "loha", peft.LoHaConfig(r=4, target_modules=["q_proj"]))
    why = refusal(lm_spec(), path)
    assert why == (f"adapter 'ad' ({path}): module model.layers.0.self_attn.q_proj: LoHa (hada_*) is a Hadamard "
                   "product of two low-rank pairs, not LoRA (and 2 more modules alike)")
    assert main(["inspect", write_config(tmp_path, model_config("llama")).as_posix(), str(path), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)[0]["rank"] is None, "no lora_A, so no rank (not 0)"


def test_an_embedding_lora_is_refused_as_one(tmp_path):
    path = trainer_file(tmp_path, "emb", peft.LoraConfig(r=4, target_modules=["embed_tokens"]),
                        keep=lambda key: "lora_embedding" in key)
    assert refusal(lm_spec(), path) == f"adapter 'ad' ({path}): module model.embed_tokens: LoRA on an embedding is " \
                                       "not served"


def test_a_text_file_named_safetensors_is_not_a_safetensors_file(tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_text("# what this run was for\n")
    assert refusal(lm_spec(), path) == f"adapter 'ad' ({path}): not a safetensors file: it begins with text, " \
                                       "b'# what t'"


def test_a_mistyped_relative_path_is_a_missing_file_named_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adapters").mkdir()
    assert refusal(lm_spec(), "adapters/sql-expertt") == \
        "adapter 'ad' (adapters/sql-expertt): no such file or directory"


def test_one_adapter_that_cannot_be_served_is_its_own_refusal(tmp_path):
    _, big = make_adapter(tmp_path, name="big", r=16)
    with pytest.raises(ValueError) as e:
        check_adapters(lm_spec(adapters={"big": str(big)}))
    assert str(e.value).startswith("adapter 'big' (") and "of 1 adapters" not in str(e.value)



def test_one_more_module_alike_is_one_module(tmp_path):
    _, path = make_adapter(tmp_path, r=16, target_modules=["q_proj"], layers_to_transform=[0, 1])
    assert refusal(lm_spec(), path / "adapter_model.safetensors").endswith(
        "module model.layers.0.self_attn.q_proj: rank 16, over this pool's max_rank 8 "
        "(and 1 more module alike)")
