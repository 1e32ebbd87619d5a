"""LoraAdapterStore: what it holds follows from hold and drop alone; reads happen once, outside the lock."""

from __future__ import annotations

import dataclasses
import json
import random
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import make_adapter, model_config

from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.store import LoadedAdapter, LoraAdapterStore, check_adapter_file


def store(capacity=3, **kw):
    spec = specs_from_config(model_config("llama"), max_rank=8, capacity=capacity)["language_model"]
    return LoraAdapterStore(spec, **{"pin": False, **kw})


@pytest.fixture(scope="module")
def adapter_path(tmp_path_factory):
    return make_adapter(tmp_path_factory.mktemp("ad"))[1]


def test_hold_reports_new_names_and_drops_least_recent_past_capacity():
    s = store(capacity=2)
    assert s.hold("a") and s.hold("b")
    assert not s.hold("a"), "already held: nothing to read"
    assert s.hold("c")
    assert s.held() == ["a", "c"], "b was the least recent"


def test_hold_keeps_names_in_keep_past_capacity():
    s = store(capacity=2)
    for n in "abc":
        s.hold(n, keep="abc")
    assert s.held() == ["a", "b", "c"]
    s.hold("d", keep=["b"])
    assert s.held() == ["b", "d"], "once keep is released the tier returns to capacity"


def test_get_does_not_change_recency(adapter_path):
    s = store(capacity=2)
    s.hold("a")
    s.hold("b")
    ad = s.read("a", adapter_path)
    assert s.put(ad) and s.get("a") is ad
    s.hold("c")
    assert s.get("a") is None and s.held() == ["b", "c"]


def test_put_for_a_name_no_longer_held_is_discarded(adapter_path):
    s = store()
    s.hold("a")
    ad = s.read("a", adapter_path)
    s.drop("a")
    assert not s.put(ad) and s.get("a") is None and "a" not in s


def test_accounting_counts_layout_bytes(adapter_path):
    s = store()
    ad = s.load("a", adapter_path)
    layout = sum(t.numel() * t.element_size() for t in (*ad.a.values(), *ad.b.values()))
    # every target of the 3-layer tiny Llama (hidden 64, 4 heads / 2 KV of 16, MLP 96) at max_rank 8, bf16
    slot = 3 * 2 * (24 * 64 + 128 * 8 + 8 * 64 + 64 * 8 + 16 * 64 + 192 * 8 + 8 * 96 + 64 * 8)
    assert len(s) == 1 and s.nbytes == ad.nbytes == layout == slot
    storage = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (*ad.a.values(), *ad.b.values())}
    assert len(storage) == 1, "one allocation per adapter"
    assert layout <= next(iter(storage.values())) < layout + 256 * 8, "only alignment beyond the layout"


class CountingStore(LoraAdapterStore):
    reads = 0

    def _read(self, *args, **kw):  # every read, read() and load()'s alike, comes through here
        type(self).reads += 1
        return super()._read(*args, **kw)


def test_load_reads_a_held_adapter_once_even_from_many_threads(adapter_path):
    spec = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
    s = CountingStore(spec, pin=False)
    got = []
    threads = [threading.Thread(target=lambda: got.append(s.load("a", adapter_path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert CountingStore.reads == 1 and len(got) == 8 and all(g is got[0] for g in got)
    assert s.load("a", adapter_path) is got[0] and CountingStore.reads == 1


def test_a_failed_read_changes_nothing_held(tmp_path):
    s = store()
    s.hold("x")
    with pytest.raises(ValueError, match="adapter 'bad'"):
        s.load("bad", tmp_path / "missing")
    assert s.held() == ["x", "bad"] and s.get("bad") is None


def test_read_with_digest_refuses_a_file_changed_since_it_was_checked(tmp_path):
    _, path = make_adapter(tmp_path)
    s = store()
    digest = check_adapter_file(s.spec, "ad", path)
    assert s.read("ad", path, digest).digest == digest
    cfg = path / "adapter_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "lora_alpha": 16}))
    with pytest.raises(ValueError, match=r"adapter 'ad' .* the file changed since"):
        s.read("ad", path, digest)
    make_adapter(tmp_path, seed=7)  # new weights, same name and path
    with pytest.raises(ValueError, match="the file changed since"):
        s.load("ad", path, digest)
    assert s.get("ad") is None


def test_load_reads_again_when_the_checked_digest_changed(tmp_path):
    _, path = make_adapter(tmp_path)
    s = store()
    old = s.load("ad", path, check_adapter_file(s.spec, "ad", path))
    make_adapter(tmp_path, seed=9)  # rewritten, then checked again by the API server
    new_digest = check_adapter_file(s.spec, "ad", path)
    new = s.load("ad", path, new_digest)
    assert new is not old and new.digest == new_digest and s.get("ad") is new
    assert s.load("ad", path, new_digest) is new


def test_many_threads_at_once_keep_every_rule(adapter_path):
    s = store(capacity=3)
    template = s.read("t", adapter_path)
    names = [f"n{i}" for i in range(6)]
    errors, bad = [], []

    def work(seed):
        rng = random.Random(seed)
        try:
            for _ in range(300):
                n = rng.choice(names)
                op = rng.random()
                if op < 0.4:
                    s.hold(n, keep=[rng.choice(names)] if rng.random() < 0.3 else ())
                elif op < 0.6:
                    s.put(dataclasses.replace(template, name=n))
                elif op < 0.9:
                    got = s.get(n)
                    if got is not None and (got.name != n or set(got.a) != set(template.a)):
                        bad.append(got)
                else:
                    s.drop(n)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not bad
    assert len(s) <= 4, "at most one name past capacity, from the last hold's keep"
    s.hold("final")
    assert len(s) == 3


def test_read_without_digest_reads_only_the_shard_and_has_no_digest(adapter_path):
    s = store()
    assert s.read("a", adapter_path).digest is None
    digest = check_adapter_file(s.spec, "a", adapter_path)
    assert s.read("a", adapter_path, digest).digest == digest


def test_pin_false_gives_ordinary_memory(adapter_path):
    ad = store(pin=False).read("a", adapter_path)
    assert isinstance(ad, LoadedAdapter) and not any(t.is_pinned() for t in ad.a.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
def test_pin_without_cuda_is_refused_at_construction():
    with pytest.raises(ValueError, match="CUDA is not available"):
        store(pin=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")
def test_pin_true_pins_exactly_the_layout(adapter_path):
    ad = store(pin=True).read("a", adapter_path)
    assert all(t.is_pinned() for t in (*ad.a.values(), *ad.b.values()))


def test_a_buffer_is_reused_only_once_nothing_views_it_and_comes_back_clean(tmp_path):
    _, full = make_adapter(tmp_path, name="full", r=8, seed=1)
    _, thin = make_adapter(tmp_path, name="thin", r=2, seed=2, layers_to_transform=[1])
    s = store(dtype=torch.float32)
    first = s.read("full", full)
    ptr = first.a["qkv_proj"].untyped_storage().data_ptr()
    before = {t: v.clone() for t, v in first.a.items()}
    kept = s.read("thin", thin)
    assert kept.a["qkv_proj"].untyped_storage().data_ptr() != ptr, "full is still viewed"
    assert all(torch.equal(first.a[t], before[t]) for t in before)
    del first
    reused = s.read("thin", thin)
    assert reused.a["qkv_proj"].untyped_storage().data_ptr() == ptr, "full's buffer, free now, is reused"
    fresh = store(dtype=torch.float32).read("thin", thin)
    for t in fresh.a:  # no weights of "full" left in the padding or the untouched layers
        assert torch.equal(reused.a[t], fresh.a[t]) and torch.equal(reused.b[t], fresh.b[t])
    assert s.mapped_bytes == 2 * buffer_bytes(reused), "two buffers of one size"


def test_spare_buffers_are_bounded(tmp_path):
    """Buffers of sizes no read wants any more are unmapped, keeping two spares."""
    s = store()
    held = [s.read(f"t{i}", make_adapter(tmp_path, name=f"t{i}", target_modules=m)[1]) for i, m in enumerate(
        (["q_proj"], ["o_proj"], ["down_proj"], ["q_proj", "o_proj"]))]  # four buffer sizes
    sizes = [buffer_bytes(h) for h in held]
    assert len(set(sizes)) == 4 and s.mapped_bytes == sum(sizes)
    del held  # now all four are spares
    last = s.read("last", make_adapter(tmp_path, name="last", target_modules=["q_proj", "down_proj"])[1])
    assert buffer_bytes(last) not in sizes
    assert s.mapped_bytes <= buffer_bytes(last) + 2 * max(sizes) < buffer_bytes(last) + sum(sizes)


def buffer_bytes(adapter: LoadedAdapter) -> int:
    """The bytes of the one host buffer an adapter's views share."""
    (size,) = {t.untyped_storage().nbytes() for t in (*adapter.a.values(), *adapter.b.values())}
    return size


names = st.sampled_from("abcdef")
calls = st.lists(st.one_of(st.tuples(st.just("hold"), names, st.frozensets(names, max_size=3)),
                           st.tuples(st.just("drop"), names, st.just(frozenset()))), max_size=40)


@settings(max_examples=200, deadline=None)
@given(calls, st.integers(1, 4))
def test_what_is_held_follows_from_hold_and_drop_alone(sequence, capacity):
    """Against the rule written out as a list: most recent last, the least recent past capacity
    dropped unless this call keeps it."""
    s = store(capacity=capacity)
    model: list[str] = []
    for op, name, keep in sequence:
        if op == "drop":
            s.drop(name)
            model = [n for n in model if n != name]
            continue
        assert s.hold(name, keep) == (name not in model)
        model = [n for n in model if n != name] + [name]
        over = len(model) - capacity
        victims = [n for n in model if n != name and n not in keep][: max(over, 0)]
        model = [n for n in model if n not in victims]
        assert s.held() == model
