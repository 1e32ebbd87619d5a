"""Device tier: copies per activation, and activation time against a memcpy of the same bytes.

Run: .venv/bin/python benchmarks/bench_pool.py
On a machine with CUDA it also times host-to-device activation from pinned memory against the
link's bandwidth measured in the same run.
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import llama8b_spec, side_by_side, write_adapters

from mstar.engine.resources.lora.pool import LoraDevicePool
from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file


def main() -> None:
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())  # removed at exit
    atexit.register(shutil.rmtree, root, True)
    large, _ = write_adapters(root)
    spec = llama8b_spec()
    digest = check_adapter_file(spec, "large", large)
    adapter = LoraAdapterStore(spec, pin=False).read("large", large, digest)
    per_module = 2 * sum(t.layers * t.slices for t in spec.targets.values())

    pool = LoraDevicePool(spec, slots=2)
    pool.activate(adapter)
    print(f"activation: {pool.copies} copies ({len(adapter.a)} targets), {pool.bytes_moved / 1e6:.1f} MB moved; "
          f"per-layer, per-module copying needs {per_module}")

    flat = torch.empty(adapter.nbytes, dtype=torch.uint8)
    src = torch.randint(0, 255, (adapter.nbytes,), dtype=torch.uint8)

    def activate():
        pool.deactivate("large")
        pool.activate(adapter)

    t = side_by_side({"activate": activate, "memcpy": lambda: flat.copy_(src)}, repeat=15)
    print(f"activate on the CPU device: {t['activate'] * 1e3:.2f} ms; memcpy of the same {adapter.nbytes / 1e6:.1f} MB "
          f"{t['memcpy'] * 1e3:.2f} ms -> {t['activate'] / t['memcpy']:.2f}x")

    if torch.cuda.is_available():
        pinned = LoraAdapterStore(spec, pin=True).read("large", large, digest)
        gpu = LoraDevicePool(spec, slots=2, device="cuda")
        host = torch.empty(pinned.nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(pinned.nbytes, dtype=torch.uint8, device="cuda")

        def h2d_activate():
            gpu.deactivate("large")
            gpu.activate(pinned)
            torch.cuda.synchronize()

        def h2d_raw():
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()

        t = side_by_side({"activate": h2d_activate, "raw": h2d_raw}, repeat=20)
        print(f"H2D activation from pinned memory: {t['activate'] * 1e3:.2f} ms = "
              f"{pinned.nbytes / t['activate'] / 1e9:.1f} GB/s; one pinned copy of the same bytes "
              f"{pinned.nbytes / t['raw'] / 1e9:.1f} GB/s -> {t['raw'] / t['activate']:.2f} of the link")


if __name__ == "__main__":
    main()
