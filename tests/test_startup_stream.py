"""The startup check's one pass over a file (stream.py): the digest it gives is the one every other path gives
(pushed tensors, main's code), whatever the block it reads in; a file rewritten in place under it is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import blake3
import pytest
import torch
from safetensors.torch import load_file, save_file
from safetensors_files import write_by_hand
from tiny import make_adapter, model_config

from mstar.engine.resources.lora import check_adapter_file, check_adapters, digest, specs_from_config
from mstar.engine.resources.lora.check import check_adapter_tensors
from mstar.engine.resources.lora.source import FileSource
from mstar.engine.resources.lora.stream import stream_hash

SPEC = specs_from_config(model_config("llama"), max_rank=24)["language_model"]
WIDE = model_config("llama", hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=8,
                    head_dim=64)
WEIGHTS = "adapter_model.safetensors"
# main's code, to check this branch's digests against: a checkout's src folder.
MAIN_SRC = Path(os.environ.get("MSTAR_MAIN_SRC", "/tmp/main-ref/src"))


def trainer_file(tmp_path: Path, name: str = "trainer.safetensors", alpha: float = 4.0) -> Path:
    """A trainer's file: each module's alpha a float32 tensor of its own beside bfloat16 factors, which
    safetensors lays out by dtype first, so the alphas lie apart from their modules (the hash reads runs)."""
    _, path = make_adapter(tmp_path, name=name + ".peft", r=8, target_modules=["q_proj", "v_proj"])
    tensors = {k.removeprefix("base_model.model."): v.to(torch.bfloat16) for k, v in load_file(path / WEIGHTS).items()}
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in tensors})
    alphas = {f"{m}.alpha": torch.tensor(alpha + i) for i, m in enumerate(modules)}
    save_file({**tensors, **alphas}, tmp_path / name)
    return tmp_path / name


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    """Files of every shape the stream meets: PEFT's own (fp32 and bf16), one over several blocks, a
    trainer's with alpha tensors apart from their modules, one written in reverse name order by hand, and one
    whose header (a long metadata note) is larger than a block."""
    tmp = tmp_path_factory.mktemp("stream")
    out = {"peft": make_adapter(tmp, name="peft", r=4)[1],
           "bf16": make_adapter(tmp, name="bf16", r=8, dtype=torch.bfloat16)[1],
           "wide": make_adapter(tmp, name="wide", r=24, config=WIDE)[1],
           "trainer": trainer_file(tmp)}
    tensors = load_file(out["peft"] / WEIGHTS)
    for name, meta in (("reversed", {"format": "pt"}), ("long-header", {"format": "pt", "note": "x" * 400_000})):
        folder = tmp / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text((out["peft"] / "adapter_config.json").read_text())
        write_by_hand(folder / WEIGHTS, sorted(tensors.items(), reverse=True), meta)
        out[name] = folder
    assert (out["wide"] / WEIGHTS).stat().st_size > 2 * digest.BLOCK
    return out


def spec_for(name: str):
    return specs_from_config(WIDE if name == "wide" else model_config("llama"), max_rank=24)["language_model"]


def pushed_digest(name: str, path: Path) -> bytes:
    """The digest of the same weights pushed from memory: read through another source and hash."""
    file = path / WEIGHTS if path.is_dir() else path
    config = json.loads((path / "adapter_config.json").read_text()) if path.is_dir() else None
    return check_adapter_tensors(spec_for(name), name, load_file(file), config)


@pytest.mark.parametrize("block", [7, 4096, None], ids=["7-bytes", "4-KiB", "default"])
def test_the_digest_is_the_pushed_tensors_whatever_the_block(adapters, monkeypatch, block):
    """Read in blocks of 7 bytes, an alpha, a header's end and every tensor straddle a block's edge: the
    digest (alphas taken from the bytes as they pass) is still the one the same weights pushed have."""
    if block is not None:
        monkeypatch.setattr(digest, "BLOCK", block)
    for name, path in adapters.items():
        assert check_adapter_file(spec_for(name), name, path, hash_threads=1) == pushed_digest(name, path), name


def test_every_core_and_one_a_worker_give_one_digest(adapters):
    for name, path in adapters.items():
        one = check_adapter_file(spec_for(name), name, path, hash_threads=1)
        assert check_adapter_file(spec_for(name), name, path) == one, name
    llama = {n: str(p) for n, p in adapters.items() if n != "wide"}
    spec = specs_from_config(model_config("llama"), max_rank=24, adapters=llama)["language_model"]
    assert check_adapters(spec, workers=3) == {n: pushed_digest(n, Path(p)) for n, p in llama.items()}


MAIN_DIGESTS = """
import json, sys
from mstar.engine.resources.lora import check_adapter_file, specs_from_config
configs, paths = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(json.dumps({n: check_adapter_file(specs_from_config(configs[n], max_rank=24)["language_model"], n, p).hex()
                  for n, p in paths.items()}))
"""


@pytest.mark.skipif(not (MAIN_SRC / "mstar").is_dir(), reason=f"no checkout of main at {MAIN_SRC} (MSTAR_MAIN_SRC)")
def test_digests_are_mains(adapters):
    """main's code, run from its own checkout, gives every file the digest this branch's one pass does."""
    configs = {n: WIDE if n == "wide" else model_config("llama") for n in adapters}
    paths = {n: str(p) for n, p in adapters.items()}
    done = subprocess.run([sys.executable, "-c", MAIN_DIGESTS, json.dumps(configs), json.dumps(paths)],
                          env={**os.environ, "PYTHONPATH": str(MAIN_SRC)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    mains = json.loads(done.stdout.splitlines()[-1])
    assert mains == {n: check_adapter_file(spec_for(n), n, p, hash_threads=1).hex() for n, p in adapters.items()}


def test_the_stream_hashes_each_runs_bytes_once_in_order_and_shows_each_to_visit(adapters, tmp_path):
    file = adapters["reversed"] / WEIGHTS
    blob = file.read_bytes()
    prefix = blob[: 8 + int.from_bytes(blob[:8], "little")]
    runs = [(len(prefix), len(prefix) + 100), (len(blob) - 50, len(blob)), (len(prefix) + 100, len(blob) - 50)]
    seen = bytearray()
    source = FileSource(file)
    try:
        got = stream_hash(source, runs, prefix, visit=lambda at, view: seen.extend(view), block=33)
    finally:
        source.close()
    want = b"".join(blob[a:b] for a, b in runs)
    assert got == blake3.blake3(want).digest() and bytes(seen) == want


class AfterFirstRead:
    """Runs act once, after the stream's first block is read (the header checked, hashing begun)."""

    def __init__(self, monkeypatch, act):
        original, self.done = os.preadv, False

        def preadv(fd, views, at):
            got = original(fd, views, at)
            if not self.done:
                self.done = True
                act()
            return got

        monkeypatch.setattr(os, "preadv", preadv)


def rewrite_in_place(file: Path, new: bytes) -> None:
    time.sleep(0.02)  # past the file system's timestamp granularity, since the check opened it
    with open(file, "r+b") as f:
        f.write(new)


def test_a_file_rewritten_in_place_while_it_is_hashed_is_refused(tmp_path, monkeypatch):
    """Another version of the same header written over the file while the check hashes it: the bytes hashed
    are part old, part new, and the check refuses rather than give that mix a digest."""
    _, path = make_adapter(tmp_path, name="ad", r=24, config=WIDE, seed=1)
    _, other = make_adapter(tmp_path, name="other", r=24, config=WIDE, seed=2)
    spec = spec_for("wide")
    new = (other / WEIGHTS).read_bytes()
    old = (path / WEIGHTS).read_bytes()
    assert len(new) == len(old) and new[:1000] == old[:1000] and new != old
    monkeypatch.setattr(digest, "BLOCK", 64 << 10)
    AfterFirstRead(monkeypatch, lambda: rewrite_in_place(path / WEIGHTS, new))
    with pytest.raises(ValueError, match=r"^adapter 'ad' \(.*adapter_model\.safetensors\): the file was written while "
                                         r"it was checked: check it again once it is written$"):
        check_adapter_file(spec, "ad", path, hash_threads=1)
    monkeypatch.undo()
    assert check_adapter_file(spec, "ad", path) == check_adapter_file(spec, "other", other), "checked again: new"


def test_a_header_rewritten_after_its_parse_is_refused_from_the_streams_own_bytes(tmp_path, monkeypatch):
    """The header parsed, then another written over the file's first bytes before the stream reads them: the
    stream's bytes are compared with those parsed, and the check refuses rather than hash another header's
    tensors under this one's manifest."""
    _, path = make_adapter(tmp_path, name="ad", r=4, seed=1)
    _, other = make_adapter(tmp_path, name="other", r=8, seed=2)
    new = (other / WEIGHTS).read_bytes()
    original = FileSource.read

    def read(source, nbytes, at):  # the header's own read, at 8, is followed by the rewrite
        data = original(source, nbytes, at)
        if at == 8:
            with open(path / WEIGHTS, "r+b") as f:
                f.write(new[:4096])
        return data

    monkeypatch.setattr(FileSource, "read", read)
    with pytest.raises(ValueError, match=r"^adapter 'ad' \(.*\): its header changed since it was read: the file was "
                                         r"rewritten in place$"):
        check_adapter_file(SPEC, "ad", path, hash_threads=1)
