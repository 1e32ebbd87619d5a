"""The digest names exactly what is served, and only what the user named is read.

Two adapters that serve different deltas never share a digest; what is served follows from the adapter's
own files alone; weights PEFT would not apply are refused, not served; a Hub id stays inside its cache.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from diffusion import WAN, save_wan_lora
from reference import lora_modules, module_input, peft_delta, slot_delta
from safetensors.torch import load_file, save_file
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file, specs_from_config

LM = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
DIT = specs_from_config(WAN, max_rank=8)["transformer"]


def read(spec, path, name="ad", dtype=torch.float32):
    digest = check_adapter_file(spec, name, path)
    return digest, LoraAdapterStore(spec, pin=False, dtype=dtype).read(name, path, digest)


def same_layout(x, y) -> bool:
    return x.scaling == y.scaling and set(x.a) == set(y.a) and all(
        torch.equal(x.a[t], y.a[t]) and torch.equal(x.b[t], y.b[t]) for t in x.a)


def test_a_single_file_is_read_with_its_own_metadata_not_a_neighbours_config(tmp_path):
    file = save_wan_lora(tmp_path / "style", lora_alpha=4)  # r 4, alpha 4: scaling 1 in its own metadata
    _, alone = read(DIT, file)
    assert alone.scaling == 1.0
    (file.parent / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 32}))  # another adapter's config lands beside it
    _, beside = read(DIT, file)
    assert same_layout(alone, beside), "the file's own LoraConfig, whatever lies beside it"
    renamed = file.parent / "adapter_model.safetensors"
    shutil.copy(file, renamed)
    assert read(DIT, renamed)[1].scaling == 8.0, "a PEFT folder's weights take the folder's config"


def test_two_configs_giving_every_module_the_same_scaling_serve_one_layout_under_one_digest(tmp_path):
    """The slots' scaling follows from the modules' scalings alone: the config's own lora_alpha / r, which
    no module takes here, is not hashed, and must not decide the layout either."""
    _, path = make_adapter(tmp_path, name="x", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           alpha_pattern={"q_proj": 12, "v_proj": 8})  # q 3.0, v 2.0: a tie
    other = tmp_path / "y"
    shutil.copytree(path, other)
    config = json.loads((other / "adapter_config.json").read_text())
    config.update(lora_alpha=12, alpha_pattern={"v_proj": 8, "q_proj": 12})  # own scaling 3.0 now
    (other / "adapter_config.json").write_text(json.dumps(config))
    for dtype in (torch.float32, torch.bfloat16):
        dx, x = read(LM, path, dtype=dtype)
        dy, y = read(LM, other, dtype=dtype)
        assert dx == dy and same_layout(x, y)


def test_weights_the_config_does_not_target_are_refused_by_name(tmp_path):
    pm, path = make_adapter(tmp_path, target_modules=["q_proj", "k_proj"])
    config = json.loads((path / "adapter_config.json").read_text())
    for change, why in (({"exclude_modules": ["k_proj"]}, "k_proj"), ({"target_modules": ["q_proj"]}, "k_proj"),
                        ({"target_modules": r".*\.q_proj"}, "k_proj")):
        (path / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=rf"module model\.layers\.0\.self_attn\.{why}: adapter_config\.json's "
                                             r"target_modules / exclude_modules leave it out.*and 2 more"):
            check_adapter_file(LM, "ad", path)
    (path / "adapter_config.json").write_text(json.dumps({**config, "target_modules": r".*\.(q|k)_proj"}))
    _, adapter = read(LM, path)
    g = torch.Generator().manual_seed(0)
    for module, layer in lora_modules(pm).items():
        x = module_input(layer, 3, g)
        torch.testing.assert_close(slot_delta(adapter.a, adapter.b, adapter.scaling, LM, module, x),
                                   peft_delta(layer, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("index", ["01", "١", "１", "+1", "1_0"])
def test_layer_indices_peft_never_writes_are_refused_naming_them(tmp_path, index):
    _, path = make_adapter(tmp_path, target_modules=["q_proj"])
    tensors = {k.replace("layers.1.", f"layers.{index}."): v for k, v in load_file(path / "adapter_model.safetensors")
               .items()}
    save_file(tensors, path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=rf"module model\.layers\.{re.escape(index)}\.self_attn\.q_proj: "):
        check_adapter_file(LM, "ad", path)


def test_expert_indices_peft_never_writes_are_refused(tmp_path):
    from moe import CONFIGS, per_expert_adapter

    spec = specs_from_config(CONFIGS["mixtral"], max_rank=8)
    _, path = per_expert_adapter(tmp_path, "mixtral")
    tensors = {k.replace("experts.1.", "experts.01."): v for k, v in load_file(path / "adapter_model.safetensors")
               .items()}
    save_file(tensors, path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.01\.w1: index '01' is not written as a model numbers"):
        check_adapter_file(spec["language_model"], "ad", path, [spec["experts"]])


def rewrite_header(file: Path, change) -> None:
    data = file.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])


@pytest.mark.parametrize("metadata", [[], 0, "", False, {"a": 1}])
def test_a_metadata_that_is_no_string_map_is_refused_as_safetensors_refuses_it(tmp_path, metadata):
    _, path = make_adapter(tmp_path)
    rewrite_header(path / "adapter_model.safetensors", lambda h: h.__setitem__("__metadata__", metadata))
    with pytest.raises(ValueError, match=r"adapter 'ad' .*__metadata__ is not a string-to-string map"):
        check_adapter_file(LM, "ad", path)


def test_a_null_metadata_is_read_as_safetensors_reads_it(tmp_path):
    _, path = make_adapter(tmp_path)
    digest = check_adapter_file(LM, "ad", path)
    rewrite_header(path / "adapter_model.safetensors", lambda h: h.__setitem__("__metadata__", None))
    assert check_adapter_file(LM, "ad", path) == digest


@pytest.mark.parametrize("field", ["lora_alpha", "r"])
def test_a_huge_integer_in_the_config_is_refused_naming_it(tmp_path, field):
    _, path = make_adapter(tmp_path)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, field: int("9" * 400)}))
    with pytest.raises(ValueError, match=rf"adapter 'ad' \(.*adapter_config.json\): {field} 9999.*\.\.\. is not"):
        check_adapter_file(LM, "ad", path)


# --- Hub ids stay inside the cache ---------------------------------------------------------------------

@pytest.fixture
def hub(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    repo = cache / "models--org--base"
    commit = "a" * 40
    _, made = make_adapter(tmp_path, name="made")
    shutil.copytree(made, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(made, elsewhere)
    (tmp_path / "pointer").write_text(str(elsewhere))  # a file whose text names a folder outside the cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path


@pytest.mark.parametrize("revision", ["../../pointer", "../../../../pointer", "main/../../../pointer", "/etc",
                                      "a//b", ".hidden", "main/"])
def test_a_hub_revision_cannot_walk_out_of_the_cache(hub, revision):
    assert check_adapter_file(LM, "x", "org/base")  # the cache works
    with pytest.raises(ValueError, match=r"adapter 'x' \(org/base@.*\): .*(not a git ref name|not one commit)"):
        check_adapter_file(LM, "x", f"org/base@{revision}")


def test_a_ref_naming_a_folder_outside_the_cache_is_refused(hub):
    (hub / "hub" / "models--org--base" / "refs" / "odd").write_text(str(hub / "elsewhere"))
    with pytest.raises(ValueError, match=r"adapter 'x' \(org/base@odd\): .*not one commit's snapshot"):
        check_adapter_file(LM, "x", "org/base@odd")


@pytest.mark.parametrize("what", ["a folder in snapshots/ not named as a commit", "another repo's commit",
                                  "a commit's folder linked elsewhere", "snapshots/ itself"])
def test_a_ref_naming_anything_but_one_commits_snapshot_is_refused(hub, what):
    """Each of the two things a snapshot is (a folder of this repo's snapshots/, named by a 40-digit commit)
    refused alone: a ref file's text is taken as the commit offline, and it may name anything."""
    repo = hub / "hub" / "models--org--base"
    made = repo / "snapshots" / ("a" * 40)
    if what == "a folder in snapshots/ not named as a commit":
        shutil.copytree(made, repo / "snapshots" / "v1-final")
        text = "v1-final"
    elif what == "another repo's commit":
        shutil.copytree(made, hub / "hub" / "models--org--other" / "snapshots" / ("b" * 40))
        text = "../../models--org--other/snapshots/" + "b" * 40
    elif what == "a commit's folder linked elsewhere":
        (repo / "snapshots" / ("c" * 40)).symlink_to(hub / "elsewhere")
        text = "c" * 40
    else:
        shutil.copy(made / "adapter_config.json", repo / "snapshots")
        shutil.copy(made / "adapter_model.safetensors", repo / "snapshots")
        text = "."
    (repo / "refs" / "odd").write_text(text)
    assert check_adapter_file(LM, "x", "org/base")  # the cache works
    with pytest.raises(ValueError, match=r"adapter 'x' \(org/base@odd\): .*not one commit's snapshot"):
        check_adapter_file(LM, "x", "org/base@odd")


def test_register_all_resolves_a_hub_id_once_and_reads_the_commit_it_checked(hub, monkeypatch):
    """main moves between the check and the registration: the version is the commit that was checked."""
    from mstar.engine.resources.lora import LoraDevicePool, LoraManager
    from mstar.engine.resources.lora import hub as hub_module

    repo = hub / "hub" / "models--org--base"
    second = "b" * 40
    _, other = make_adapter(hub, name="other", seed=9)
    shutil.copytree(other, repo / "snapshots" / second)
    resolve, calls = hub_module.resolve, []

    def moving(source):
        found = resolve(source)
        if hub_module.hub_id(source) is not None:  # a Hub id, not the folder it resolved to
            calls.append(found)
        (repo / "refs" / "main").write_text(second)  # main moves right after each resolution
        return found

    monkeypatch.setattr(hub_module, "resolve", moving)
    m = LoraManager({"language_model": LoraAdapterStore(LM, pin=False)}, {"language_model": LoraDevicePool(LM, 2)})
    v = m.register_all({"x": "org/base"})["x"]
    assert len(calls) == 1 and Path(v.path).name == "a" * 40
    assert v.digest == check_adapter_file(LM, "x", repo / "snapshots" / ("a" * 40))
