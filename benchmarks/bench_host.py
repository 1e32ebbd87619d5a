"""Host tier speed: the startup check and read, side by side with what they must keep up with.

Run: .venv/bin/python benchmarks/bench_host.py
All ratios come from one run, page cache warm, so the machine's noise cancels out. "cold" is a
header never seen before; "warm" one seen before, as for the second and later adapters of one
training recipe (byte-identical headers), or a re-read after an eviction.
"""

from __future__ import annotations

import mmap
import sys
import tempfile
from pathlib import Path

import blake3
import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import llama8b_spec, side_by_side, status_kb, write_adapters

from mstar.engine.resources.lora import safetensors_header
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file, inspect_adapter
from mstar.engine.resources.lora.tools.samples import sample_modules, write_peft_adapter


def raw_hash(file: Path) -> bytes:
    with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return blake3.blake3(mm, max_threads=blake3.blake3.AUTO).digest()


class Memcpy:
    """A plain copy of the file's bytes out of the page cache into memory already touched, as a
    store's reused buffer is."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.dst = torch.zeros(file.stat().st_size, dtype=torch.uint8)

    def __call__(self) -> None:
        with open(self.file, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.dst.copy_(torch.frombuffer(mm, dtype=torch.uint8))


def cold(fn):
    """fn with the header caches emptied first: a header never seen."""
    def run():
        safetensors_header._parse_cached.cache_clear()
        return fn()
    return run


def ms(t: float) -> str:
    return f"{t * 1e3:.2f} ms"


def main() -> None:
    torch.set_num_threads(1)  # one reader thread, as an engine's loader would use
    root = Path(tempfile.mkdtemp())
    large, small = write_adapters(root)
    file = large / "adapter_model.safetensors"
    size = file.stat().st_size
    spec = llama8b_spec()
    thin = write_peft_adapter(root / "thin", sample_modules(spec, 1, dtype=torch.bfloat16), alpha=2)
    print(f"adapter: {size / 1e6:.1f} MB (Llama-3-8B shape, 32 layers, 7 linears, r=16, bf16); small: "
          f"{(small / 'adapter_model.safetensors').stat().st_size / 1e6:.2f} MB (7 modules); thin: the 224 "
          f"modules at r=1, {(thin / 'adapter_model.safetensors').stat().st_size / 1e6:.1f} MB")

    t = side_by_side({"large cold": cold(lambda: inspect_adapter(spec, large)),
                      "small cold": cold(lambda: inspect_adapter(spec, small)),
                      "thin cold": cold(lambda: inspect_adapter(spec, thin))}, repeat=15)
    t.update(side_by_side({"large warm": lambda: inspect_adapter(spec, large),
                           "small warm": lambda: inspect_adapter(spec, small)}, repeat=15))
    print(f"inspect_adapter cold: large {ms(t['large cold'])}, small {ms(t['small cold'])} -> "
          f"{t['large cold'] / t['small cold']:.2f}x (target <= 2x); thin {ms(t['thin cold'])} -> large/thin "
          f"{t['large cold'] / t['thin cold']:.2f}x: the time follows the header, not the weights")
    print(f"inspect_adapter warm: large {ms(t['large warm'])}, small {ms(t['small warm'])} -> "
          f"{t['large warm'] / t['small warm']:.2f}x")

    t = side_by_side({"cold": cold(lambda: check_adapter_file(spec, "large", large)),
                      "warm": lambda: check_adapter_file(spec, "large", large), "hash": lambda: raw_hash(file)})
    for k in ("cold", "warm"):
        print(f"check_adapter_file {k}: {ms(t[k])} = {size / t[k] / 1e9:.2f} GB/s; raw BLAKE3 of the file "
              f"{ms(t['hash'])} = {size / t['hash'] / 1e9:.2f} GB/s -> {t['hash'] / t[k]:.2f} (target >= 0.8)")

    digest = check_adapter_file(spec, "large", large)
    ws1 = LoraAdapterStore(spec, pin=False)
    ws8 = LoraAdapterStore(spec, rank=3, world_size=8, pin=False)
    memcpy = Memcpy(file)
    t = side_by_side({
        "read cold": cold(lambda: ws1.read("large", large)),
        "read": lambda: ws1.read("large", large),
        "read+digest": lambda: ws1.read("large", large, digest),
        "read ws8": lambda: ws8.read("large", large),
        "read ws8 cold": cold(lambda: ws8.read("large", large)),
        "load_file": lambda: safetensors.torch.load_file(file),
        "memcpy": memcpy,
        "hash": lambda: raw_hash(file),
    })
    for k in ("read cold", "read"):
        print(f"{k.replace('read', 'read (world size 1)')}: {ms(t[k])}; safetensors load_file {ms(t['load_file'])}"
              f" -> {t[k] / t['load_file']:.2f}x (target <= 1.5x); memcpy of the file {ms(t['memcpy'])} -> "
              f"{t[k] / t['memcpy']:.2f}x (target <= 2x)")
    print(f"read with digest: {ms(t['read+digest'])}; read + raw hash {ms(t['read'] + t['hash'])} -> "
          f"{t['read+digest'] / (t['read'] + t['hash']):.2f}x (target <= 1x)")
    print(f"read, rank 3 of 8, no digest: {ms(t['read ws8'])} -> {t['read ws8'] / t['read']:.2f}x of world size 1; "
          f"cold {ms(t['read ws8 cold'])} -> {t['read ws8 cold'] / t['read cold']:.2f}x (target <= 0.5x)")

    fresh = LoraAdapterStore(spec, pin=False)  # no spare buffer to reuse
    anon0, hwm0 = status_kb("RssAnon"), status_kb("VmHWM")
    adapter = fresh.read("large", large, digest)
    anon1, hwm1 = status_kb("RssAnon"), status_kb("VmHWM")
    print(f"memory: layout {adapter.nbytes / 1e6:.1f} MB; anonymous resident memory added by one read into a new "
          f"store {(anon1 - anon0) / 1e3:.1f} MB; peak resident (VmHWM) rose {(hwm1 - hwm0) / 1e3:.1f} MB")


if __name__ == "__main__":
    main()
