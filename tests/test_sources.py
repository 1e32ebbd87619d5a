"""Where adapters come from: tensors pushed from memory, Hugging Face Hub ids (offline, from a cache laid out
as huggingface_hub lays it out), a host budget in bytes, and memory that comes back."""

from __future__ import annotations

import gc
import json
import multiprocessing
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from managers import one_node
from peft.utils import get_peft_model_state_dict
from reference import lora_modules, module_input, peft_delta, slot_delta
from tiny import make_adapter, model_config, write_config

from mstar.engine.resources.lora import (
    LoraAdapterStore,
    LoraManager,
    Request,
    check_adapter_file,
    specs_from_config,
)
from mstar.engine.resources.lora.check import check_adapter_tensors

CONFIG = model_config("llama")
PATTERNS = {"rank_pattern": {"k_proj": 2}, "alpha_pattern": {"v_proj": 3, "down_proj": 24}}


def spec(**kw):
    return specs_from_config(CONFIG, max_rank=8, **kw)["language_model"]


def pushed(pm):
    """What a trainer pushes: PEFT's own state dict of the adapter and its LoraConfig."""
    return get_peft_model_state_dict(pm), pm.peft_config["default"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pushed_tensors_give_the_files_digest_layout_and_peft_numerics(tmp_path, dtype):
    pm, path = make_adapter(tmp_path, dtype=dtype, **PATTERNS)
    tensors, config = pushed(pm)
    before = {k: v.clone() for k, v in tensors.items()}
    s = spec()
    digest = check_adapter_file(s, "ad", path)
    assert check_adapter_tensors(s, "ad", tensors, config) == digest, "the digest of the same weights as a file"
    store = LoraAdapterStore(s, pin=False, dtype=torch.float32)
    from_file, from_memory = store.read("ad", path, digest), store.read_tensors("ad", tensors, config, digest)
    assert from_memory.digest == digest and from_memory.scaling == from_file.scaling
    for t in from_file.a:
        assert torch.equal(from_memory.a[t], from_file.a[t]) and torch.equal(from_memory.b[t], from_file.b[t])
    pm = pm.float()
    g = torch.Generator().manual_seed(0)
    for module, layer in lora_modules(pm).items():
        x = module_input(layer, 4, g)
        got = slot_delta(from_memory.a, from_memory.b, from_memory.scaling, s, module, x)
        torch.testing.assert_close(got, peft_delta(layer, x), rtol=1e-5, atol=1e-5, msg=module)
    assert all(torch.equal(tensors[k], before[k]) for k in before), "the caller's tensors are never written"


def test_pushed_tensors_shard_as_the_file_does(tmp_path):
    pm, path = make_adapter(tmp_path, **PATTERNS)
    tensors, config = pushed(pm)
    for rank in range(2):
        store = LoraAdapterStore(spec(), rank, 2, pin=False)
        a, b = store.read("ad", path), store.read_tensors("ad", tensors, config)
        assert all(torch.equal(a.a[t], b.a[t]) and torch.equal(a.b[t], b.b[t]) for t in a.a), f"rank {rank} of 2"


def test_pushed_tensors_changed_after_the_push_are_refused(tmp_path):
    pm, _ = make_adapter(tmp_path)
    tensors, config = pushed(pm)
    s = spec()
    digest = check_adapter_tensors(s, "ad", tensors, config)
    next(iter(tensors.values())).add_(1)  # the trainer writes its weights in place, without pushing them again
    with pytest.raises(ValueError, match=r"adapter 'ad' \(<pushed tensors>\): .*the tensors changed since they "
                                         r"were pushed"):
        LoraAdapterStore(s, pin=False).read_tensors("ad", tensors, config, digest)


@pytest.mark.parametrize(("tensors", "config", "why"), [
    ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": [1.0]}, {}, "a list, not a tensor"),
    ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 64)}, None,
     "PEFT's keys with no config"),
    ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 64, dtype=torch.complex64)},
     {}, "dtype torch.complex64"),
    ({}, None, "it holds no tensors"),
    ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 64)}, {"use_dora": True},
     "DoRA"),
])
def test_pushed_tensors_that_cannot_be_served_are_refused_by_name(tensors, config, why):
    with pytest.raises(ValueError, match=rf"(?s)adapter 'ad' \(<pushed tensors>\): .*{why}"):
        check_adapter_tensors(spec(), "ad", tensors, config)


def manager() -> LoraManager:
    return one_node(capacity=8)


def admit(m: LoraManager, running: list[Request], request: Request):
    m.step(running, [request])
    m.wait_for_reads()
    step = m.step(running, [request])
    assert step.admitted == [request.id]
    return step


def test_a_push_through_the_manager_is_a_reload(tmp_path):
    _, path = make_adapter(tmp_path, name="old", seed=1)
    new_pm, _ = make_adapter(tmp_path, name="new", seed=2)
    m = manager()
    old = m.register("policy", path)
    admit(m, [], Request(1, "policy"))
    new = m.push("policy", *pushed(new_pm))
    step = admit(m, [Request(1, "policy")], Request(2, "policy"))
    assert step.digest == {1: old.digest, 2: new.digest} and step.slot[1] != step.slot[2]
    pool, store = m.pools["language_model"], m.stores["language_model"]
    copy = store.get(new.key)
    assert all(torch.equal(pool.a[t][step.slot[2]], copy.a[t]) for t in copy.a)
    from_file = LoraAdapterStore(spec(dtype=torch.float32), pin=False).read("x", path)
    assert all(torch.equal(pool.a[t][step.slot[1]], from_file.a[t]) for t in from_file.a), "the old weights run on"


# --- Hub ids -----------------------------------------------------------------------------------------

COMMITS = ["1" * 40, "2" * 40]


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A cache as huggingface_hub lays one out (blobs, snapshots of symlinks, refs), the Hub unreachable."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    repo = cache / "models--org--adapter"
    for i, commit in enumerate(COMMITS):
        _, made = make_adapter(tmp_path, name=f"made{i}", seed=i + 1)
        for f in made.iterdir():
            blob = repo / "blobs" / f"{i}-{f.name}"
            blob.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, blob)
            link = repo / "snapshots" / commit / f.name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(Path("../../blobs") / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMITS[0])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo


def test_a_hub_id_is_checked_and_read_from_its_cache(hub_cache, tmp_path):
    s = spec()
    local = check_adapter_file(s, "x", hub_cache / "snapshots" / COMMITS[0])
    assert check_adapter_file(s, "x", "org/adapter") == local
    assert check_adapter_file(s, "x", f"org/adapter@{COMMITS[1]}") != local, "a revision is the weights there"


def test_a_hub_ids_default_name_is_its_repo_and_a_short_revision(hub_cache, capsys):
    from mstar.engine.resources.lora.checkpoint import default_name, open_checkpoint
    from mstar.engine.resources.lora.tools.cli import main

    assert default_name("org/adapter") == "adapter"
    assert default_name(f"org/adapter@{COMMITS[1]}") == "adapter@" + COMMITS[1][:12]
    assert default_name("org/adapter@release/v2") == "adapter@release-v2", "a ref's slash is no path"
    with open_checkpoint(f"org/adapter@{COMMITS[1]}") as ckpt:
        assert ckpt.name == "adapter@" + COMMITS[1][:12]
    config = write_config(hub_cache.parent, model_config("llama"))
    assert main(["check", str(config), "org/adapter", f"org/adapter@{COMMITS[1]}", "--max-rank", "8", "--json"]) == 0
    assert [r["adapter"] for r in json.loads(capsys.readouterr().out)] == ["adapter", "adapter@" + COMMITS[1][:12]]


def test_registering_a_hub_id_pins_its_commit(hub_cache):
    m = manager()
    v = m.register("x", "org/adapter")
    assert Path(v.path).name == COMMITS[0]
    (hub_cache / "refs" / "main").write_text(COMMITS[1])  # main moves on after the registration
    step = admit(m, [], Request(1, "x"))
    assert step.digest[1] == v.digest, "every read uses the commit registered"
    assert m.register("y", "org/adapter").digest != v.digest, "a new registration takes main as it is now"


@pytest.mark.parametrize(("source", "why"), [
    ("org/nothing", r"no such file or directory; read as a Hub id, it is not in the local Hub cache"),
    ("org/adapter@v9", r"no such file or directory; read as a Hub id, its revision 'v9' is not in the local Hub cache"),
])
def test_a_hub_id_that_cannot_be_found_is_refused_naming_it_once(hub_cache, source, why):
    with pytest.raises(ValueError, match=rf"^adapter 'x' \({source}\): {why}") as e:
        check_adapter_file(spec(), "x", source)
    assert str(e.value).count(source) == 1, "the path once, not three times"
    with pytest.raises(ValueError, match=why):
        manager().register("x", source)


# --- a budget in bytes -------------------------------------------------------------------------------

names = st.sampled_from("abcdef")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(names, st.integers(1, 50), st.frozensets(names, max_size=2)), max_size=40),
       st.integers(1, 5), st.integers(10, 120))
def test_what_is_held_under_a_byte_budget_follows_from_the_holds_alone(holds, capacity, budget):
    """Against the rule as a list: most recent last; the least recent dropped, unless the hold keeps
    them, while more are held than capacity or their bytes exceed the budget."""
    store = LoraAdapterStore(spec(capacity=capacity), pin=False, max_bytes=budget)
    model: list[tuple[str, int]] = []
    for name, size, keep in holds:
        assert store.hold(name, keep, size) == (name not in [n for n, _ in model])
        model = [(n, b) for n, b in model if n != name] + [(name, size)]
        for n, b in list(model[:-1]):
            if len(model) <= capacity and sum(b for _, b in model) <= budget:
                break
            if n not in keep:
                model.remove((n, b))
        assert [n for n, _ in model] == store.held() and store.held_bytes == sum(b for _, b in model)


def test_the_manager_prefetches_within_the_byte_budget(tmp_path):
    paths = {n: make_adapter(tmp_path, name=n, seed=i, target_modules=["q_proj"])[1] for i, n in enumerate("abc")}
    m = manager()  # a budget is set below, once a size is known
    versions = {n: m.register(n, p) for n, p in paths.items()}
    size = versions["a"].nbytes["language_model"]
    m.stores["language_model"].max_bytes = 2 * size
    m.step([], [Request(i, n) for i, n in enumerate("abc")])
    assert len(m.stores["language_model"].held()) == 2 and m.stores["language_model"].held_bytes == 2 * size


# --- memory that comes back --------------------------------------------------------------------------

def resident_anonymous_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon")


def held_then_dropped(tmp: str) -> tuple[int, int, int, int]:
    """In a process of its own (the pytest process's heap holds what earlier tests left): six adapters loaded
    and dropped; (bytes held, RssAnon grown while held in KB, mapped bytes left, RssAnon left in KB)."""
    big = model_config("llama", hidden_size=1024, intermediate_size=4096, num_attention_heads=16, head_dim=64)
    paths = [make_adapter(Path(tmp), name=f"a{i}", seed=i, r=16, config=big)[1] for i in range(6)]
    s = specs_from_config(big, max_rank=16, capacity=8)["language_model"]
    store = LoraAdapterStore(s, pin=False, dtype=torch.float32)
    gc.collect()
    before = resident_anonymous_kb()
    for i, p in enumerate(paths):
        store.load(f"a{i}", p)
    held, grown = store.nbytes, resident_anonymous_kb() - before
    for i in range(len(paths)):
        store.drop(f"a{i}")
    gc.collect()
    store.trim()
    return held, grown, store.mapped_bytes, resident_anonymous_kb() - before


def test_host_memory_comes_back_once_every_adapter_is_dropped(tmp_path):
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        held, grown, mapped, left = pool.submit(held_then_dropped, str(tmp_path)).result(timeout=300)
    assert held > 20e6 and grown > held / 1e3 * 0.9
    assert mapped == 0
    assert left < 4_000, "within a few MB of where it was"
