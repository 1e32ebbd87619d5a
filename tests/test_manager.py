"""LoraManager: per-step admission that never waits on a read, reloads, failures that stay with their adapter."""

from __future__ import annotations

import threading
import time

import peft
import pytest
import torch
from managers import one_node as manager
from managers import settle
from tiny import build_model, make_adapter, model_config

from mstar.engine.resources.lora import LoraAdapterStore, LoraDevicePool, specs_from_config
from mstar.engine.resources.lora.manager import LoraManager, Request
from mstar.engine.resources.lora.tools.hf import TokenSlots, attach

CONFIG = model_config("llama")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("manager")
    return {n: make_adapter(root, name=n, seed=i + 1, r=2 + 2 * i)[1] for i, n in enumerate("abcd")}


def serve(m: LoraManager, waiting: list[Request]) -> tuple[list, dict]:
    """Steps, waiting for reads between them, until every request is admitted or failed (at most three,
    for a read lands or fails within one step); what was admitted and failed."""
    admitted, failed = [], {}
    for _ in range(3):
        running = [r for r in waiting if r.id in admitted]
        step = m.step(running, [r for r in waiting if r.id not in failed and r.id not in admitted])
        admitted += step.admitted
        failed.update(step.failed)
        m.wait_for_reads()
    assert len(admitted) + len(failed) == len(waiting)
    return admitted, failed


class BlockedStore(LoraAdapterStore):
    """A store whose reads wait until the test lets them go: a disk that is slow for as long as it likes."""

    go = threading.Event()

    def read(self, *args, **kw):
        assert self.go.wait(timeout=60), "the test never let the read go"
        return super().read(*args, **kw)


def test_a_step_never_waits_on_a_read_and_admits_once_it_lands(adapters):
    BlockedStore.go.clear()
    m = manager(store_class=BlockedStore)
    m.register("a", adapters["a"])
    first = m.step([], [Request(1, "a"), Request(2, None)])  # returns although the read cannot finish
    assert first.admitted == [2] and first.slot == {2: -1} and m.counters.waiting_on_adapter == 1
    BlockedStore.go.set()
    m.wait_for_reads()
    second = m.step([Request(2, None)], [Request(1, "a")])
    assert second.admitted == [1] and second.slot[1] >= 0 and second.digest[1] == m.registry.resolve("a").digest
    c = m.counters
    assert (c.reads, c.host_misses, c.host_hits, c.waiting_on_adapter) == (1, 1, 0, 0)


def test_an_adapter_not_registered_fails_its_requests_at_once(adapters):
    m = manager()
    step = m.step([], [Request(1, "nope")])
    assert list(step.failed) == [1] and "adapter 'nope' is not registered" in str(step.failed[1])


def test_no_more_adapters_are_admitted_than_device_slots(adapters):
    m = manager(slots=2)
    for n in "abc":
        m.register(n, adapters[n])
    waiting = [Request(i, n) for i, n in enumerate("abca")]
    step = settle(m, [], waiting)
    assert step.admitted == [0, 1, 3], "c waits: a and b hold both slots, the second a shares its slot"
    running = [Request(i, n) for i, n in ((0, "a"), (1, "b"), (3, "a"))]
    assert m.step(running, [Request(2, "c")]).admitted == []
    step = m.step([Request(0, "a")], [Request(2, "c")])  # b's request finished
    assert step.admitted == [2] and step.slot[2] != step.slot[0]


def test_prefetch_stays_within_capacity_and_never_evicts_the_running_batch(adapters):
    m = manager(capacity=2, slots=2)
    for n in "abcd":
        m.register(n, adapters[n])
    settle(m, [], [Request(0, "a")])
    running = [Request(0, "a")]
    m.step(running, [Request(i, n) for i, n in ((1, "b"), (2, "c"), (3, "d"))])
    m.wait_for_reads()
    held = m.stores["language_model"].held()
    assert len(held) == 2 and any(k.startswith("a@") for k in held) and any(k.startswith("b@") for k in held)


def test_a_reload_gives_new_requests_new_weights_and_running_ones_their_old(tmp_path):
    _, path = make_adapter(tmp_path, name="x", seed=1)
    old_model = peft.PeftModel.from_pretrained(build_model(CONFIG), path).eval()
    m = manager()
    old = m.register("x", path)
    step = settle(m, [], [Request("before", "x")])
    assert step.admitted == ["before"]
    _, new_path = make_adapter(tmp_path, name="x2", seed=7)
    new = m.register("x", new_path)
    assert new.digest != old.digest
    running = [Request("before", "x")]
    step = settle(m, running, [Request("after", "x")])
    assert step.admitted == ["after"] and step.digest == {"before": old.digest, "after": new.digest}
    assert step.slot["before"] != step.slot["after"]
    model = build_model(CONFIG)
    slots = TokenSlots()
    attach(model, m.pools, slots)
    ids = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    slots.rows = torch.tensor([step.slot["before"], step.slot["after"]])
    with torch.no_grad():
        got = model(ids).logits
        want_old = old_model(ids[:1]).logits
        want_new = peft.PeftModel.from_pretrained(build_model(CONFIG), new_path)(ids[1:]).logits
    torch.testing.assert_close(got[:1], want_old, rtol=1e-4, atol=1e-4, msg="admitted before the reload: old weights")
    torch.testing.assert_close(got[1:], want_new, rtol=1e-4, atol=1e-4, msg="admitted after: new weights")
    m.step([Request("after", "x")], [])  # the last request on the old weights is done
    keys = m.stores["language_model"].held() + [k for k in m.pools["language_model"].resident() if k]
    assert old.key not in keys and new.key in keys, "the old version is gone from host and device"


def test_unregistering_refuses_new_requests_and_frees_memory_when_the_last_is_done(adapters):
    m = manager()
    v = m.register("a", adapters["a"])
    settle(m, [], [Request(1, "a")])
    m.unregister("a")
    step = m.step([Request(1, "a")], [Request(2, "a")])
    assert "not registered" in str(step.failed[2]) and step.slot[1] >= 0
    assert v.key in m.stores["language_model"].held(), "still running"
    m.step([], [])
    assert v.key not in m.stores["language_model"].held() and v.key not in m.pools["language_model"].resident()


@pytest.mark.parametrize("damage", ["vanished", "changed", "truncated"])
def test_a_failed_read_fails_only_its_adapters_requests_and_can_be_registered_again(tmp_path, adapters, damage):
    _, path = make_adapter(tmp_path, name="bad", seed=3)
    weights = path / "adapter_model.safetensors"
    original = weights.read_bytes()
    m = manager()
    m.register("bad", path)
    m.register("a", adapters["a"])
    if damage == "vanished":
        weights.unlink()
    elif damage == "changed":
        make_adapter(tmp_path, name="bad", seed=4)
    else:
        weights.write_bytes(original[: len(original) // 2])
    admitted, failed = serve(m, [Request(1, "bad"), Request(2, "a")])
    why = {"vanished": "no adapter_model.safetensors", "changed": "the file changed since",
           "truncated": "bad safetensors file"}[damage]
    assert list(failed) == [1] and admitted == [2], "only the bad adapter's request fails"
    assert str(failed[1]).startswith("adapter 'bad' (") and why in str(failed[1])
    assert m.step([Request(2, "a")], [Request(3, "bad")]).failed[3] is failed[1], "refused at once from now on"
    assert m.counters.read_failures == 1 and m.counters.failed_requests == 2
    weights.write_bytes(original)  # fixed
    m.register("bad", path)
    assert settle(m, [Request(2, "a")], [Request(4, "bad")]).admitted == [4]


def test_a_running_request_the_manager_never_admitted_is_refused(adapters):
    m = manager()
    m.register("a", adapters["a"])
    with pytest.raises(ValueError, match="request 9 runs adapter 'a' without this manager having admitted it"):
        m.step([Request(9, "a")], [])


def test_register_all_names_every_bad_adapter_before_registering_any(tmp_path, adapters):
    _, big = make_adapter(tmp_path, name="big", r=16)
    m = manager()
    with pytest.raises(ValueError, match=r"1 of 2 adapters cannot be served:\nadapter 'big' .*rank 16"):
        m.register_all({"a": adapters["a"], "big": big})
    assert len(m.registry) == 0
    assert set(m.register_all({"a": adapters["a"], "b": adapters["b"]})) == {"a", "b"}


class SlowStore(LoraAdapterStore):
    """A store whose reads of one digest wait until the test lets them go."""

    slow: bytes | None = None
    go = threading.Event()

    def _read(self, ckpt, digest):
        if digest == self.slow:
            assert self.go.wait(timeout=60)
        return super()._read(ckpt, digest)


def test_load_does_not_join_a_read_under_way_for_another_digest(tmp_path):
    from mstar.engine.resources.lora import check_adapter_file

    _, path = make_adapter(tmp_path, name="x", seed=1)
    spec = specs_from_config(CONFIG, max_rank=8)["language_model"]
    old = check_adapter_file(spec, "x", path)
    store = SlowStore(spec, pin=False)
    SlowStore.slow, results = old, {}
    SlowStore.go.clear()
    first = threading.Thread(target=lambda: results.setdefault("old", _try(store.load, "x", path, old)))
    first.start()
    make_adapter(tmp_path, name="x", seed=2)  # rewritten and checked again while the old read waits
    new = check_adapter_file(spec, "x", path)
    second = threading.Thread(target=lambda: results.setdefault("new", _try(store.load, "x", path, new)))
    second.start()
    SlowStore.go.set()
    first.join()
    second.join()
    # the old digest's read has the old file open (safetensors saves by replacing the file), or refuses
    assert isinstance(results["old"], ValueError) or results["old"].digest == old
    assert results["new"].digest == new and store.get("x").digest == new


def _try(fn, *args):
    try:
        return fn(*args)
    except ValueError as e:
        return e


def test_a_new_adapter_never_takes_the_slot_of_a_running_one(adapters):
    m = manager(slots=2)
    for n in "abc":
        m.register(n, adapters[n])
    assert serve(m, [Request(1, "a")])[0] == [1]
    running = [Request(1, "a")]
    assert settle(m, running, [Request(2, "b")]).admitted == [2]  # a's slot is now the least recently filled
    step = settle(m, running, [Request(3, "c")])  # b's request is done: c takes b's slot, not a's
    assert step.admitted == [3] and step.slot[1] != step.slot[3]
    assert m.pools["language_model"].resident()[step.slot[1]].startswith("a@")


def test_a_request_heard_of_during_the_forward_is_admitted_at_the_next_step(adapters):
    m = manager()
    m.register("a", adapters["a"])
    m.prefetch([Request(1, "a")])  # the engine hears of it while the forward runs
    m.wait_for_reads()  # the forward takes longer than the read
    assert m.step([], [Request(1, "a")]).admitted == [1]
    assert (m.counters.host_hits, m.counters.host_misses) == (1, 0)


def test_a_request_for_an_adapter_the_batch_runs_is_admitted_at_once(adapters):
    m = manager()
    m.register("a", adapters["a"])
    assert serve(m, [Request(1, "a")])[0] == [1]
    step = m.step([Request(1, "a")], [Request(2, "a")])
    assert step.admitted == [2] and step.slot[2] == step.slot[1]


class SlowPut(LoraAdapterStore):
    """A store whose puts linger after the copy is in: the moment a step may evict and hold the name again."""

    def put(self, adapter):
        kept = super().put(adapter)
        time.sleep(0.002)
        return kept


def test_a_copy_evicted_and_held_again_while_its_read_lands_is_read_again(adapters):
    """With room for one adapter and requests for two in turns, every eviction races a read landing:
    no name may stay held with no copy and no read."""
    m = manager(capacity=1, slots=1, store_class=SlowPut)
    for n in "ab":
        m.register(n, adapters[n])
    waits: dict[int, int] = {}
    running: list[Request] = []
    for t in range(300):
        want = Request(t, "ab"[t % 2])
        for _ in range(40):
            step = m.step(running, [want])
            if step.admitted:
                break
            time.sleep(0.001)
        waits[t] = _
        assert step.admitted == [t], f"request {t} for {want.adapter} never admitted"
        running = []  # done at once: the next request's adapter evicts this one's
    assert m.counters.evictions > 100


def test_an_adapter_over_the_host_budget_alone_is_refused_at_registration(adapters):
    spec = specs_from_config(CONFIG, max_rank=8, capacity=4, dtype=torch.float32)["language_model"]
    m = LoraManager({"language_model": LoraAdapterStore(spec, pin=False, max_bytes=1000)},
                    {"language_model": LoraDevicePool(spec, 2, dtype=torch.float32)})
    with pytest.raises(ValueError, match=r"adapter 'a' \(.*\): its copy takes \d+ host bytes for language_model, "
                                         r"over the host budget of 1000"):
        m.register("a", adapters["a"])
    with pytest.raises(ValueError, match="2 of 2 adapters cannot be served"):
        m.register_all({"a": adapters["a"], "b": adapters["b"]})
    assert len(m.registry) == 0


def test_registering_again_right_after_a_failed_read_is_served(tmp_path):
    _, path = make_adapter(tmp_path, name="x", seed=3)
    weights = path / "adapter_model.safetensors"
    original = weights.read_bytes()
    m = manager()
    m.register("x", path)
    weights.write_bytes(original[:100])
    m.step([], [Request(1, "x")])
    m.wait_for_reads()  # failed in the background, not yet agreed by a step
    weights.write_bytes(original)
    m.register("x", path)  # the same weights, so the same version
    admitted, failed = serve(m, [Request(2, "x")])
    assert admitted == [2] and not failed


def test_a_failed_read_leaves_no_memory_mapped(tmp_path):
    """The refusal a failed read leaves behind holds no frame, and so no buffer, of the read."""
    import gc

    good = [make_adapter(tmp_path, name=f"g{i}", seed=i, r=8)[1] for i in range(3)]
    m = manager(capacity=8)
    for i, path in enumerate(good):
        m.register(f"g{i}", path)
        (path / "adapter_config.json").write_text((path / "adapter_config.json").read_text().replace(
            '"lora_alpha": 8', '"lora_alpha": 9'))  # changed since its check: the read fails after its copy
    _, failed = serve(m, [Request(i, f"g{i}") for i in range(3)])
    assert len(failed) == 3
    gc.collect()
    store = m.stores["language_model"]
    store.trim()
    assert store.held_bytes == 0 and store.mapped_bytes == 0, "a failed read's buffer is unmapped"


def test_load_holds_the_bytes_the_copy_takes_within_the_budget(adapters):
    spec = specs_from_config(CONFIG, max_rank=8, capacity=4, dtype=torch.float32)["language_model"]
    probe = LoraAdapterStore(spec, pin=False)
    size = probe.load("a", adapters["a"]).nbytes
    s = LoraAdapterStore(spec, pin=False, max_bytes=size + 1)
    s.hold("a", nbytes=size)
    s.load("a", adapters["a"])
    assert s.held_bytes == size, "load keeps the size, it does not reset it to 0"
    s.load("b", adapters["b"])
    assert s.held() == ["b"], "the budget holds through load: b's bytes push a out"


class LateFailure(LoraAdapterStore):
    """A store whose failed reads report late: the moment an operator fixes the file and registers again."""

    late = threading.Event()

    def read(self, *args, **kw):
        try:
            return super().read(*args, **kw)
        except ValueError:
            assert self.late.wait(timeout=60)
            raise


def test_registering_again_while_the_failing_read_is_in_flight_is_served(tmp_path):
    _, path = make_adapter(tmp_path, name="x", seed=3)
    weights = path / "adapter_model.safetensors"
    original = weights.read_bytes()
    LateFailure.late.clear()
    m = manager(store_class=LateFailure)
    m.register("x", path)
    weights.write_bytes(original[:100])
    m.step([], [Request(1, "x")])  # its read fails, but says so only once let go
    weights.write_bytes(original)
    m.register("x", path)
    LateFailure.late.set()
    m.wait_for_reads()
    admitted, failed = serve(m, [Request(2, "x")])
    assert admitted == [2] and not failed
