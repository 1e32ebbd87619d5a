"""Host tier speed: the startup check and read, side by side with what they must keep up with.

Run: .venv/bin/python benchmarks/bench_host.py
All ratios come from one run, page cache warm, so the machine's noise cancels out.
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

from mstar.engine.resources.lora.samples import sample_modules, write_peft_adapter
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file, inspect_adapter


def raw_hash(file: Path) -> bytes:
    with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return blake3.blake3(mm, max_threads=blake3.blake3.AUTO).digest()


def memcpy(file: Path) -> torch.Tensor:
    """A plain copy of the file's bytes out of the page cache into fresh memory."""
    with open(file, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    src = torch.frombuffer(mm, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    del src
    return dst


def main() -> None:
    torch.set_num_threads(1)  # one reader thread, as an engine's loader would use
    root = Path(tempfile.mkdtemp())
    large, small = write_adapters(root)
    file = large / "adapter_model.safetensors"
    size = file.stat().st_size
    spec = llama8b_spec()
    print(f"adapter: {size / 1e6:.1f} MB (Llama-3-8B shape, 32 layers, 7 linears, r=16, bf16); "
          f"small: {(small / 'adapter_model.safetensors').stat().st_size / 1e6:.2f} MB")

    t = side_by_side({"inspect large": lambda: inspect_adapter(spec, large),
                      "inspect small": lambda: inspect_adapter(spec, small)}, repeat=15)
    print(f"inspect_adapter: large {t['inspect large'] * 1e3:.2f} ms, small {t['inspect small'] * 1e3:.2f} ms, "
          f"ratio {t['inspect large'] / t['inspect small']:.2f}x (target <= 2x; the small one has 7 modules, "
          "the large 224)")
    thin = write_peft_adapter(root / "thin", sample_modules(spec, 1, dtype=torch.bfloat16), alpha=2)
    t = side_by_side({"large": lambda: inspect_adapter(spec, large), "thin": lambda: inspect_adapter(spec, thin)},
                     repeat=15)
    print(f"inspect_adapter on the same 224 modules at r=16 ({size / 1e6:.0f} MB) and r=1 "
          f"({(thin / 'adapter_model.safetensors').stat().st_size / 1e6:.1f} MB): {t['large'] * 1e3:.2f} ms and "
          f"{t['thin'] * 1e3:.2f} ms -> {t['large'] / t['thin']:.2f}x: the time follows the header, not the weights")

    t = side_by_side({"check": lambda: check_adapter_file(spec, "large", large), "hash": lambda: raw_hash(file)})
    print(f"check_adapter_file: {t['check'] * 1e3:.1f} ms = {size / t['check'] / 1e9:.2f} GB/s; raw BLAKE3 of the "
          f"file {t['hash'] * 1e3:.1f} ms = {size / t['hash'] / 1e9:.2f} GB/s; throughput ratio "
          f"{t['hash'] / t['check']:.2f} (target >= 0.8)")

    digest = check_adapter_file(spec, "large", large)
    ws1 = LoraAdapterStore(spec, pin=False)
    ws8 = LoraAdapterStore(spec, rank=3, world_size=8, pin=False)
    t = side_by_side({
        "read": lambda: ws1.read("large", large),
        "read+digest": lambda: ws1.read("large", large, digest),
        "read ws8": lambda: ws8.read("large", large),
        "load_file": lambda: safetensors.torch.load_file(file),
        "memcpy": lambda: memcpy(file),
        "hash": lambda: raw_hash(file),
    })
    print(f"read (world size 1): {t['read'] * 1e3:.1f} ms; safetensors load_file {t['load_file'] * 1e3:.1f} ms "
          f"-> {t['read'] / t['load_file']:.2f}x (target <= 1.5x); memcpy of the file {t['memcpy'] * 1e3:.1f} ms "
          f"-> {t['read'] / t['memcpy']:.2f}x (target <= 2x)")
    print(f"read with digest: {t['read+digest'] * 1e3:.1f} ms; read + raw hash {(t['read'] + t['hash']) * 1e3:.1f} ms "
          f"-> {t['read+digest'] / (t['read'] + t['hash']):.2f}x (target <= 1x)")
    print(f"read, rank 3 of 8, no digest: {t['read ws8'] * 1e3:.1f} ms -> {t['read ws8'] / t['read']:.2f}x of "
          f"world size 1 (target <= 0.5x)")

    fresh = LoraAdapterStore(spec, pin=False)  # no spare buffer to reuse
    anon0, hwm0 = status_kb("RssAnon"), status_kb("VmHWM")
    adapter = fresh.read("large", large, digest)
    anon1, hwm1 = status_kb("RssAnon"), status_kb("VmHWM")
    print(f"memory: layout {adapter.nbytes / 1e6:.1f} MB; anonymous resident memory added by one read "
          f"{(anon1 - anon0) / 1e3:.1f} MB; peak resident (VmHWM) rose {(hwm1 - hwm0) / 1e3:.1f} MB "
          "(file pages of the page cache count in it while mapped)")


if __name__ == "__main__":
    main()
