"""A step's cost against the names registered, and what a registered name costs in memory until first used.

Run: .venv/bin/python benchmarks/bench_names.py [--names 1000 10000 100000] [--runs 9]

The tiny Llama of the demo (tiny-llama), 8 adapter files and N names sharing them (each name its own
adapter to the pool: its own version, read and held on its own). Each file is checked once and its
version registered under every name that shares it (register_all takes the checked versions, hashing
nothing again). Every step gets 64 running requests on 32 names whose copies are in slots, and 256
waiting requests on names spread over all N: the queue's heads are held and read as room allows, the
rest wait, which is a server's steady state under load. A run times 300 steps after 50 to settle, and
gives their median; runs alternate the sizes, and each size's figure is the median of its runs' medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from mstar.engine.resources.lora.manager import LoraManager, Request
from mstar.engine.resources.lora.models import load_config
from mstar.engine.resources.lora.tools.samples import sample_modules, write_peft_adapter

FILES, RUNNING, WAITING = 8, 64, 256


def build(root: Path, n: int) -> tuple[LoraManager, int]:
    """A manager with n names registered; and the bytes their registration took, traced."""
    m = LoraManager.build(load_config("tiny-llama"), max_rank=8, host_capacity=128, slots=64, dtype=torch.float32,
                          pin=False, read_workers=2)
    spec = m.stores["language_model"].spec
    files = {}
    for i in range(FILES):
        path = root / f"f{i}"
        if not path.exists():
            write_peft_adapter(path, sample_modules(spec, 8, seed=i), alpha=16)
        files[f"f{i}"] = path
    checked = m.check_all(files)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    m.register_all({f"lora{i}": dataclasses.replace(checked[f"f{i % FILES}"], name=f"lora{i}") for i in range(n)})
    gc.collect()
    per_name = (tracemalloc.get_traced_memory()[0] - before) / n
    tracemalloc.stop()
    return m, per_name


def run(m: LoraManager, n: int, seed: int) -> float:
    rng = random.Random(seed)
    hot = [f"lora{i}" for i in range(32)]
    waiting = [Request(1000 + i, f"lora{rng.randrange(32, n)}") for i in range(WAITING)]
    queue = [Request(i, hot[i % 32]) for i in range(RUNNING)]
    while queue:  # the running batch admitted, its copies in slots
        step = m.step([], queue)
        queue = [r for r in queue if r.id not in step.admitted]
        m.wait_for_reads()
    running = [Request(i, hot[i % 32]) for i in range(RUNNING)]
    times = []
    for k in range(350):
        t = time.perf_counter()
        m.step(running, waiting)
        if k >= 50:
            times.append(time.perf_counter() - t)
    m.wait_for_reads()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--names", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--runs", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())
    try:
        managers, memory = {}, {}
        for n in args.names:
            t = time.perf_counter()
            managers[n], memory[n] = build(root, n)
            print(f"{n:>7} names registered in {time.perf_counter() - t:.2f} s, {memory[n]:.0f} bytes a name")
        medians: dict[int, list[float]] = {n: [] for n in args.names}
        for r in range(args.runs):
            for n in args.names:
                medians[n].append(run(managers[n], n, seed=r))
        base = statistics.median(medians[args.names[0]])
        print("names    step median   vs the first")
        for n in args.names:
            med = statistics.median(medians[n])
            print(f"{n:>7}  {med * 1e3:8.3f} ms   {med / base:5.2f}x")
        for m in managers.values():
            m.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
