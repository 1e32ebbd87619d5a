"""Model configs: every way one is named (dict, PretrainedConfig, file, model folder, preset), and hostile ones,
which are a ValueError naming the config and the field, never a crash or a hang."""

from __future__ import annotations

import json
import os
import threading

import pytest
from diffusion import FLUX, WAN, transformer
from moe import CONFIGS as MOE
from tiny import make_adapter, model_config, write_config

import mstar.engine.resources.lora as lora
from mstar.engine.resources.lora import LoraManager, specs_from_config
from mstar.engine.resources.lora.checkpoint import open_checkpoint
from mstar.engine.resources.lora.models import load_config, presets


def summary(specs: dict) -> dict:
    """What decides a spec: each node's targets, patterns and key conversion (LoraSpec compares by identity)."""
    return {n: (dict(s.targets), s.patterns, s.convert_keys, s.max_rank) for n, s in specs.items()}


def specs(config, **kw) -> dict:
    return summary(specs_from_config(config, max_rank=8, **kw))


def promptly(fn, fifo=None):
    """fn's result, or a failure if it blocks (a reader stuck on a FIFO is let go first)."""
    out: list = []

    def run():
        try:
            out.append(fn())
        except Exception as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("blocked")
    return out[0]


# --- where a config comes from --------------------------------------------------------------------

@pytest.mark.parametrize("config", [model_config("llama"), model_config("qwen2_vl"), MOE["mixtral"]],
                         ids=["llama", "qwen2_vl", "mixtral"])
def test_a_pretrained_config_and_its_saved_folder_read_as_its_dict(tmp_path, config):
    import transformers

    pretrained = transformers.AutoConfig.for_model(**config)
    assert specs(pretrained) == specs(config)
    pretrained.save_pretrained(tmp_path)
    assert specs(tmp_path) == specs(config), "a model folder is read by its config.json"
    assert specs(tmp_path / "config.json") == specs(config)


def test_a_manager_builds_from_a_pretrained_config_and_a_folder(tmp_path):
    import transformers

    pretrained = transformers.AutoConfig.for_model(**model_config("llama"))
    pretrained.save_pretrained(tmp_path / "model")
    _, path = make_adapter(tmp_path)
    digests = {LoraManager.build(c, max_rank=8, host_capacity=1, slots=1).register("ad", path).digest
               for c in (pretrained, tmp_path / "model", model_config("llama"))}
    assert len(digests) == 1


@pytest.mark.parametrize("config", [WAN, FLUX], ids=["wan", "flux"])
def test_a_diffusers_model_folder_and_pipeline_folder_are_read(tmp_path, config):
    transformer(config).save_config(tmp_path / "model")
    assert specs(tmp_path / "model") == specs(config)
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "model_index.json").write_text("{}")
    transformer(config).save_config(tmp_path / "pipe" / "transformer")
    assert specs(tmp_path / "pipe") == specs(config), "a pipeline's transformer/config.json"


def test_a_folder_without_a_config_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=rf"model folder {tmp_path}: no config.json in it"):
        specs_from_config(tmp_path, max_rank=8)


def test_the_package_loads_its_names_on_first_use():
    assert set(lora._HOMES) == set(lora.__all__)
    for name in lora.__all__:
        assert getattr(lora, name) is not None


# --- hostile configs ------------------------------------------------------------------------------

def _set(config: dict, path: str, value) -> dict:
    """config with the field at path (dots into nested configs) set to value."""
    out = json.loads(json.dumps(config))
    *outer, last = path.split(".")
    inner = out
    for key in outer:
        inner = inner[key]
    inner[last] = value
    return out


HOSTILE = [
    ("llama", "num_attention_heads", 0), ("llama", "hidden_size", "128"), ("llama", "num_hidden_layers", None),
    ("llama", "model_type", [1]), ("llama", "intermediate_size", True), ("llama", "head_dim", 1.5),
    ("llama", "num_key_value_heads", -2), ("llama", "num_key_value_heads", 0), ("llama", "hidden_size", 2**40),
    ("qwen2_vl", "text_config", [1]), ("qwen2_vl", "vision_config", "x"), ("qwen2_vl", "vision_config.depth", 0),
    ("qwen2_vl", "vision_config.mlp_ratio", "4"), ("qwen2_vl", "text_config.num_attention_heads", 0),
    ("qwen2_vl", "vision_config.temporal_patch_size", None),
    ("mixtral", "num_local_experts", 0), ("mixtral", "num_local_experts", "4"), ("qwen3_moe", "mlp_only_layers", "x"),
    ("qwen3_moe", "moe_intermediate_size", None), ("qwen3_moe", "decoder_sparse_step", 0),
    ("wan", "patch_size", [1, 2]), ("wan", "patch_size", 2), ("wan", "num_attention_heads", 0),
    ("wan", "image_dim", "big"), ("wan", "_class_name", ["WanTransformer3DModel"]),
    ("flux", "guidance_embeds", "yes"), ("flux", "in_channels", None), ("flux", "patch_size", 0),
    ("flux", "num_single_layers", 0.5),
]
BASES = {"llama": model_config("llama"), "qwen2_vl": model_config("qwen2_vl"), "wan": WAN, "flux": FLUX, **MOE}


@pytest.mark.parametrize(("base", "field", "value"), HOSTILE, ids=[f"{b}.{f}={v!r}" for b, f, v in HOSTILE])
def test_a_hostile_field_is_a_value_error_naming_config_and_field(tmp_path, base, field, value):
    config = write_config(tmp_path, _set(BASES[base], field, value))
    with pytest.raises(ValueError) as e:
        specs_from_config(config, max_rank=8)
    assert f"model config {config}: {field} is " in str(e.value)


@pytest.mark.parametrize("preset", presets())
def test_every_field_a_builder_reads_is_checked(preset):
    """Each field of each preset (and of its nested configs) set to a string, then to 0: a ValueError naming
    the config, or the same specs (a field no builder reads); never a TypeError or a spec built from it."""
    config = load_config(preset)
    fields = [k for k in config] + [f"{k}.{inner}" for k, v in config.items() if isinstance(v, dict) for inner in v]
    want = specs(config)
    for field in fields:
        for value in ("x", 0):
            try:
                got = specs(_set(config, field, value))
            except ValueError as e:
                assert str(e).startswith("model config: "), (field, value, e)
            else:
                assert got == want, f"{field}={value!r} was read unchecked"


def test_deeply_nested_json_is_a_value_error(tmp_path):
    for i, text in enumerate(["[" * 100_000, '{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"]):
        path = tmp_path / f"deep{i}.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=rf"model config {path}: nested too deeply to read as JSON"):
            specs_from_config(path, max_rank=8)


def test_a_name_too_long_or_an_unreadable_file_is_a_value_error(tmp_path):
    for config in ["a" * 300, *(["/proc/self/mem"] if os.path.exists("/proc/self/mem") else [])]:
        with pytest.raises(ValueError, match=r"^model config .*: unreadable \("):
            specs_from_config(config, max_rank=8)


def test_a_fifo_or_a_device_as_model_config_is_refused_at_once(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    for config in (fifo, tmp_path, "/dev/null"):  # tmp_path: a folder whose config.json is the FIFO
        e = promptly(lambda c=config: specs_from_config(c, max_rank=8), fifo)
        assert isinstance(e, ValueError) and "not a regular file" in str(e), e


def test_a_fifo_swapped_in_after_the_check_is_refused_without_blocking(tmp_path, monkeypatch):
    from mstar.engine.resources.lora import json_file as json_file_module

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    monkeypatch.setattr(json_file_module, "_regular_file", lambda path: None)  # as if swapped in after it
    e = promptly(lambda: json_file_module.read_json(fifo), fifo)
    assert isinstance(e, ValueError) and "not a regular file" in str(e), e


def test_an_adapter_config_that_is_a_fifo_is_refused_at_once(tmp_path):
    _, path = make_adapter(tmp_path)
    (path / "adapter_config.json").unlink()
    os.mkfifo(path / "adapter_config.json")
    e = promptly(lambda: open_checkpoint(path), path / "adapter_config.json")
    assert isinstance(e, ValueError) and "adapter_config.json is not a regular file" in str(e), e
