"""What the digest covers: each tensor's dtype beside its bytes, and the bytes in module-name order whatever
order the file lays them out in (safetensors sorts by dtype, then name; other writers keep their own order)."""

from __future__ import annotations

import random

import safetensors.torch
import torch
from peft.utils import get_peft_model_state_dict
from safetensors_files import data_start, file_order, load, metadata, write_by_hand
from tiny import make_adapter, model_config

from mstar.engine.resources.lora.check import check_adapter_tensors
from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file

SPEC = specs_from_config(model_config("llama"), max_rank=8)["language_model"]
WEIGHTS = "adapter_model.safetensors"


def test_the_same_bytes_as_bf16_and_as_f16_digest_apart(tmp_path):
    _, path = make_adapter(tmp_path, dtype=torch.bfloat16)
    as_bf16 = check_adapter_file(SPEC, "ad", path)
    tensors = load(path / WEIGHTS)
    safetensors.torch.save_file({k: v.view(torch.float16) for k, v in tensors.items()}, path / WEIGHTS,
                                metadata(path / WEIGHTS))
    assert check_adapter_file(SPEC, "ad", path) != as_bf16, "other values, the same bytes"


def test_tensors_laid_out_in_any_order_digest_and_read_alike(tmp_path):
    _, path = make_adapter(tmp_path)
    digest = check_adapter_file(SPEC, "ad", path)
    tensors = load(path / WEIGHTS)
    meta = metadata(path / WEIGHTS)
    want = LoraAdapterStore(SPEC, pin=False).read("ad", path, digest)
    for order in (sorted(tensors, reverse=True), random.Random(0).sample(sorted(tensors), len(tensors))):
        write_by_hand(path / WEIGHTS, [(k, tensors[k]) for k in order], meta)
        assert file_order(path / WEIGHTS) == order
        assert check_adapter_file(SPEC, "ad", path) == digest
        got = LoraAdapterStore(SPEC, pin=False).read("ad", path, digest)
        assert all(torch.equal(got.a[t], want.a[t]) and torch.equal(got.b[t], want.b[t]) for t in want.a)


def test_a_file_of_float32_and_bf16_modules_digests_as_its_tensors_pushed_and_laid_out_by_name(tmp_path):
    pm, path = make_adapter(tmp_path)
    pushed = {k: v.bfloat16() if ".layers.1." in k else v for k, v in get_peft_model_state_dict(pm).items()}
    on_file = {f"base_model.model.{k.removeprefix('base_model.model.')}": v for k, v in pushed.items()}
    safetensors.torch.save_file(on_file, path / WEIGHTS, metadata(path / WEIGHTS))
    assert file_order(path / WEIGHTS) != sorted(on_file), "the premise: safetensors puts the float32 ones first"
    digest = check_adapter_file(SPEC, "ad", path)
    assert check_adapter_tensors(SPEC, "ad", pushed, pm.peft_config["default"]) == digest
    write_by_hand(path / WEIGHTS, sorted(on_file.items()), metadata(path / WEIGHTS))
    assert check_adapter_file(SPEC, "ad", path) == digest


def test_the_same_bytes_split_at_other_ranks_between_modules_digest_apart(tmp_path):
    """Layer 0's q_proj at rank 4 and layer 1's at rank 2, or the other way round, every scaling 2: the same
    names, dtypes, scalings and stream of bytes in name order, and two adapters serving different deltas."""
    q = [f"layers.{i}.self_attn.q_proj" for i in (0, 1)]
    lora = {"target_modules": ["q_proj"], "layers_to_transform": [0, 1], "lora_alpha": 8}
    _, x = make_adapter(tmp_path, name="x", rank_pattern={q[0]: 4, q[1]: 2}, alpha_pattern={q[0]: 8, q[1]: 4}, **lora)
    _, y = make_adapter(tmp_path, name="y", rank_pattern={q[0]: 2, q[1]: 4}, alpha_pattern={q[0]: 4, q[1]: 8}, **lora)
    xs, ys = load(x / WEIGHTS), load(y / WEIGHTS)
    stream = torch.cat([xs[k].reshape(-1) for k in sorted(xs)])
    at = 0
    for k in sorted(ys):
        ys[k] = stream[at : at + ys[k].numel()].reshape(ys[k].shape).clone()
        at += ys[k].numel()
    assert at == stream.numel() and {k: v.shape for k, v in xs.items()} != {k: v.shape for k, v in ys.items()}
    safetensors.torch.save_file(ys, y / WEIGHTS, metadata(y / WEIGHTS))
    assert check_adapter_file(SPEC, "x", x) != check_adapter_file(SPEC, "y", y)


def test_pushed_tensors_that_are_strided_views_digest_as_their_values(tmp_path):
    """A trainer's state dict may hold transposed views: their values are hashed, as a file holds them."""
    pm, path = make_adapter(tmp_path)
    tensors = get_peft_model_state_dict(pm)
    strided = {k: v.t().contiguous().t() for k, v in tensors.items()}  # the same values, column-major
    assert not any(v.is_contiguous() for v in strided.values())
    config = pm.peft_config["default"]
    assert check_adapter_tensors(SPEC, "ad", strided, config) == check_adapter_file(SPEC, "ad", path)


def test_the_first_and_the_last_byte_of_the_tensors_each_change_the_digest(tmp_path):
    _, path = make_adapter(tmp_path)
    file = path / WEIGHTS
    before = check_adapter_file(SPEC, "ad", path)
    original = file.read_bytes()
    for at in (data_start(original[:8]), len(original) - 1):
        changed = bytearray(original)
        changed[at] ^= 1
        file.write_bytes(bytes(changed))
        assert check_adapter_file(SPEC, "ad", path) != before, f"byte {at} of {len(original)}"
