"""Reads under a digest after the first: only this rank's bytes, each run checked against the fingerprint
taken from the bytes that hashed to the digest."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft.utils import get_peft_model_state_dict
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file, specs_from_config
from mstar.engine.resources.lora.check import check_adapter_tensors
from mstar.engine.resources.lora.source import FileSource

CONFIG = model_config("llama", num_attention_heads=8, num_key_value_heads=8, head_dim=8)
SPEC = specs_from_config(CONFIG, max_rank=8)["language_model"]
WEIGHTS = "adapter_model.safetensors"


def same(x, y) -> bool:
    return x.scaling == y.scaling and set(x.a) == set(y.a) and all(
        torch.equal(x.a[t], y.a[t]) and torch.equal(x.b[t], y.b[t]) for t in x.a)


class Counted:
    """The bytes reads take from files, counted at the one place every file read goes through."""

    def __init__(self, monkeypatch):
        self.bytes = 0
        original = FileSource.read_into

        def read_into(source, views, at, nbytes=None):
            self.bytes += sum(len(v) for v in views)
            return original(source, views, at, nbytes)

        monkeypatch.setattr(FileSource, "read_into", read_into)


@pytest.fixture
def adapter(tmp_path):
    _, path = make_adapter(tmp_path, name="ad", r=4, config=CONFIG, alpha_pattern={"down_proj": 3})
    return path, check_adapter_file(SPEC, "ad", path)


def test_a_read_after_the_first_reads_only_this_ranks_bytes_and_serves_the_same(adapter, monkeypatch):
    path, digest = adapter
    raw = (path / WEIGHTS).read_bytes()
    size = len(raw) - 8 - int.from_bytes(raw[:8], "little")  # the tensors' bytes, past the header
    store = LoraAdapterStore(SPEC, 3, 8, pin=False)
    first = store.read("ad", path, digest)
    counted = Counted(monkeypatch)
    again = store.read("ad", path, digest)
    assert counted.bytes < 0.7 * size, "rank 3 of 8 reads its share, not the whole file"
    assert same(first, again) and same(again, LoraAdapterStore(SPEC, 3, 8, pin=False).read("ad", path))
    counted.bytes = 0
    LoraAdapterStore(SPEC, 3, 8, pin=False, verify="digest").read("ad", path, digest)
    assert counted.bytes >= size, "verify='digest' hashes every tensor's bytes on every read"


def test_a_file_rewritten_in_place_after_the_first_read_is_refused(adapter, tmp_path):
    path, digest = adapter
    store = LoraAdapterStore(SPEC, pin=False)
    store.read("ad", path, digest)
    data = bytearray((path / WEIGHTS).read_bytes())
    data[-3] ^= 0x40  # one bit of one weight, same size, same header
    (path / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"adapter 'ad' \(.*\): the \d+ bytes at offset \d+ differ from those that "
                                         r"hashed to its digest: the file changed since"):
        store.read("ad", path, digest)


def test_a_config_changed_after_the_first_read_is_refused(adapter):
    path, digest = adapter
    store = LoraAdapterStore(SPEC, pin=False)
    store.read("ad", path, digest)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 99}))
    with pytest.raises(ValueError, match="names, shapes or scalings differ from those that hashed"):
        store.read("ad", path, digest)


def test_a_new_version_under_the_old_digest_is_refused_after_the_first_read(adapter, tmp_path):
    path, digest = adapter
    store = LoraAdapterStore(SPEC, pin=False)
    want = store.read("ad", path, digest)
    _, other = make_adapter(tmp_path, name="other", r=4, config=CONFIG, alpha_pattern={"down_proj": 3}, seed=7)
    shutil.copy(other / WEIGHTS, path / WEIGHTS)
    with pytest.raises(ValueError, match="differ from those that hashed to its digest"):
        store.read("ad", path, digest)
    assert same(LoraAdapterStore(SPEC, pin=False).read("ad", other), store.read("ad", other))
    assert not same(want, store.read("ad", other))


def test_pushed_tensors_stepped_after_the_first_read_are_refused(tmp_path):
    pm, _ = make_adapter(tmp_path, r=4, config=CONFIG)
    tensors, config = get_peft_model_state_dict(pm), pm.peft_config["default"]
    digest = check_adapter_tensors(SPEC, "ad", tensors, config)
    store = LoraAdapterStore(SPEC, pin=False)
    first = store.read_tensors("ad", tensors, config, digest)
    assert same(first, store.read_tensors("ad", tensors, config, digest))
    next(t for k, t in tensors.items() if "lora_A" in k).mul_(1.5)  # an optimizer step, in place
    with pytest.raises(ValueError, match="the tensors changed since they were pushed"):
        store.read_tensors("ad", tensors, config, digest)


BIG = model_config("llama", hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=8,
                   head_dim=64)


@pytest.mark.parametrize(("rank", "world", "dtype"), [(0, 1, torch.float32), (1, 2, torch.bfloat16)],
                         ids=["fp32-direct", "bf16-staged-rank-1-of-2"])
def test_a_first_read_under_a_digest_past_the_hashs_chunk_lays_out_what_a_plain_read_does(tmp_path, rank, world,
                                                                                          dtype):
    """Over 2 MiB, the hash reads the file in chunks and the read lays its pieces out of them as they pass:
    a piece begun in one chunk and ended in the next is copied from both (the digest covers the bytes
    streamed, so a piece left half-copied would be served under it with no error)."""
    from mstar.engine.resources.lora.checkpoint import open_checkpoint
    from mstar.engine.resources.lora.digest import CHUNK, hash_runs

    spec = specs_from_config(BIG, max_rank=24)["language_model"]
    _, path = make_adapter(tmp_path, r=24, config=BIG, alpha_pattern={"down_proj": 3})
    with open_checkpoint(path) as ckpt:
        runs = hash_runs(ckpt, spec.convert_keys)
        cuts = {at for start, stop in runs for at in range(start + CHUNK, stop, CHUNK)}
        across = [e for e in ckpt.header.tensors.values() if any(e.start < c < e.stop for c in cuts)]
    assert sum(stop - start for start, stop in runs) > CHUNK and across, "a tensor across two chunks"
    digest = check_adapter_file(spec, "ad", path)
    verified = LoraAdapterStore(spec, rank, world, pin=False, dtype=dtype).read("ad", path, digest)
    plain = LoraAdapterStore(spec, rank, world, pin=False, dtype=dtype).read("ad", path)
    assert same(verified, plain)


def test_fingerprints_are_taken_before_folds_write_in_place(tmp_path):
    """An fp32 adapter read into fp32 slots lands where it is served, and an alpha_pattern's own scaling is
    folded into its B there (at r = max_rank, B lands unpadded, where the slot has it): the fingerprints are of
    the bytes as read, so the read after an eviction (which checks them) serves it again rather than calling
    the file changed."""
    _, path = make_adapter(tmp_path, r=SPEC.max_rank, config=CONFIG, alpha_pattern={"down_proj": 3})
    digest = check_adapter_file(SPEC, "ad", path)
    store = LoraAdapterStore(SPEC, pin=False, dtype=torch.float32)
    first = store.load("ad", path, digest)
    store.drop("ad")
    assert "ad" not in store
    again = store.load("ad", path, digest)
    assert again is not first and same(first, again)
    assert same(again, LoraAdapterStore(SPEC, pin=False, dtype=torch.float32).read("ad", path)), "as a plain read"
