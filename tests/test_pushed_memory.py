"""Pushed tensors whose storage does not hold their values (freed, as FSDP frees a parameter's between uses;
shrunk; a FakeTensor's; a nested tensor) are refused by name, at the push and again when they are read:
their bytes are read at their storage's address, and reading past its end would read other memory."""

from __future__ import annotations

import pytest
import torch
from peft.utils import get_peft_model_state_dict
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import LoraAdapterStore, LoraDevicePool, LoraManager, Request, specs_from_config
from mstar.engine.resources.lora.check import check_adapter_tensors
from mstar.engine.resources.lora.source import TensorSource

SPEC = specs_from_config(model_config("llama"), max_rank=8, dtype=torch.float32)["language_model"]
KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture
def pushed(tmp_path):
    pm, _ = make_adapter(tmp_path)
    return get_peft_model_state_dict(pm), pm.peft_config["default"]


def freed(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def shrunk(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.nbytes // 2)


def view_of_shrunk(tensors: dict, key: str) -> None:
    """A view past the first row, its storage cut short of its last bytes: its offset counts."""
    tensors[key] = tensors[key][1:]
    tensors[key].untyped_storage().resize_(800)


def strided(tensors: dict, key: str, short: int) -> None:
    """Every other column of a storage twice as wide, that storage cut to `short` elements short of the last
    one the view reaches (a non-contiguous view: its extent is its strides', not its numel's)."""
    t = tensors[key]
    wide = torch.zeros(t.shape[0], 2 * t.shape[1], dtype=t.dtype)
    wide[:, ::2] = t
    tensors[key] = wide[:, ::2]
    reach = (t.shape[0] - 1) * wide.stride(0) + (t.shape[1] - 1) * 2 + 1
    wide.untyped_storage().resize_((reach - short) * t.element_size())


def fake(tensors: dict, key: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        tensors[key] = mode.from_tensor(tensors[key])


def nested(tensors: dict, key: str) -> None:
    t = tensors[key]
    tensors[key] = torch.nested.nested_tensor([t[0], t[1, :-1]])


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("spoil", "why"), [
    (lambda ts, k: freed(ts[k]), "reaches byte 1024 of its storage, which holds 0"),
    (lambda ts, k: shrunk(ts[k]), "reaches byte 1024 of its storage, which holds 512"),
    (view_of_shrunk, "reaches byte 1024 of its storage, which holds 800"),
    (lambda ts, k: strided(ts, k, 1), "reaches byte 2044 of its storage, which holds 2040"),
    (fake, "is a FakeTensor, whose storage does not hold its values"),
    (nested, "is a nested tensor"),
], ids=["freed", "shrunk", "a-view-of-a-shrunk-one", "a-strided-view-one-element-short", "fake", "nested"])
def test_a_pushed_tensor_whose_storage_does_not_hold_it_is_refused_by_name(pushed, spoil, why):
    tensors, config = pushed
    assert tensors[KEY].nbytes == 1024, "the premise: the sizes the reasons name"
    spoil(tensors, KEY)
    where = rf"(?s)adapter 'ad' \(<pushed tensors>\): .*{KEY.replace('.', '[.]')} {why}"
    with pytest.raises(ValueError, match=where):
        check_adapter_tensors(SPEC, "ad", tensors, config)
    with pytest.raises(ValueError, match=where):
        LoraAdapterStore(SPEC, pin=False).read_tensors("ad", tensors, config)


def test_a_strided_view_whose_storage_ends_at_its_last_element_is_read(pushed):
    tensors, config = pushed
    want = check_adapter_tensors(SPEC, "ad", tensors, config)
    strided(tensors, KEY, 0)
    assert not tensors[KEY].is_contiguous()
    assert check_adapter_tensors(SPEC, "ad", tensors, config) == want, "the same weights, the same digest"
    store = LoraAdapterStore(SPEC, pin=False)
    assert torch.equal(store.read_tensors("ad", tensors, config, want).a["qkv_proj"],
                       store.read_tensors("ad", {**tensors, KEY: tensors[KEY].contiguous()}, config).a["qkv_proj"])


def test_a_tensor_freed_after_its_push_fails_its_adapters_read_not_the_process(pushed):
    """The manager reads a push at a later step; by then its storage may be gone."""
    tensors, config = pushed
    pool = LoraDevicePool(SPEC, 2, dtype=torch.float32)
    m = LoraManager({"language_model": LoraAdapterStore(SPEC, pin=False)}, {"language_model": pool})
    m.push("policy", tensors, config)
    freed(tensors[KEY])
    m.step([], [Request(1, "policy")])
    m.wait_for_reads()
    step = m.step([], [Request(1, "policy")])
    assert not step.admitted
    assert "adapter 'policy' (<pushed tensors>)" in str(step.failed[1])
    assert f"{KEY} reaches byte 1024 of its storage, which holds 0" in str(step.failed[1])


def test_a_tensor_freed_while_its_bytes_are_read_is_refused_not_read_past_its_end():
    """The check at the push cannot see a storage freed later; the source looks again before it reads."""
    t = torch.arange(64, dtype=torch.float32)
    source = TensorSource([t], [0], t.nbytes)
    freed(t)
    with pytest.raises(ValueError, match="a pushed tensor reaches byte 256 of its storage, which holds 0"):
        source.read_into([memoryview(bytearray(t.nbytes))], 0)


def test_a_tensor_freed_between_two_reads_of_its_bytes_is_refused_at_the_second():
    """A read copies a tensor in chunks and runs; its storage may go between them (a 2 MB chunk of a 64 MB
    tensor hashed, then FSDP frees it): the second chunk is refused, never read at the old address."""
    t = torch.arange(1 << 20, dtype=torch.float32)
    source = TensorSource([t], [0], t.nbytes)
    first = memoryview(bytearray(1 << 16))
    source.read_into([first], 0)
    assert bytes(first) == t[: 1 << 14].clone().numpy().tobytes()
    freed(t)
    with pytest.raises(ValueError, match="a pushed tensor reaches byte 4194304 of its storage, which holds 0"):
        source.read_into([memoryview(bytearray(1 << 16))], 1 << 16)


def test_a_tensor_given_other_data_after_its_read_began_is_refused():
    """param.data = ... swaps what a tensor holds: its new bytes are not the ones the read's header lists."""
    t = torch.nn.Parameter(torch.arange(64, dtype=torch.float32), requires_grad=False)
    source = TensorSource([t], [0], t.nbytes)
    source.read_into([memoryview(bytearray(64))], 0)
    t.data = torch.zeros(128)
    with pytest.raises(ValueError, match="a pushed tensor holds 512 bytes, not the 256 it was pushed with"):
        source.read_into([memoryview(bytearray(64))], 64)
    t.data = torch.ones(64)  # as large again, elsewhere: read where it is now
    out = memoryview(bytearray(64))
    source.read_into([out], 64)
    assert bytes(out) == torch.ones(16).numpy().tobytes()
