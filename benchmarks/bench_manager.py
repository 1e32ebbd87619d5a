"""A serving trace in the shape of S-LoRA's evaluation, through the manager and through a baseline.

Run: .venv/bin/python benchmarks/bench_manager.py [--seconds 30] [--adapters 5 100 1000 2000]

Requests arrive as a Poisson process at 10 req/s, each naming one of n adapters with power-law
popularity (alpha = 1), with input and output lengths uniform in [8, 512]. The adapters are
Llama-7B-shaped, rank 8 on q/k/v/o (16.8 MB each); at most 100 distinct files, names beyond that
share them (each name is still its own adapter to the pool, read and held on its own). Everything
the pool does is real: checks, reads from the files, the host tier, copies into device slots (on
the CPU here). The model's step is not run: it is the time an A100 step of Llama-7B takes, spent
asleep, as a GPU forward leaves the host free. The cost model (fp16, continuous batching):

    step = 12 ms (the weights read once) + 0.1 ms per prefill token + 0.12 ms per decoding request

which gives about 13 ms at batch 1 and 20 ms at batch 64 in decode, and about 10k prefill tokens/s,
as measured for Llama-7B on an A100. The LoRA kernels' own cost is the engine's, not the pool's,
and is left out. The engine admits requests in queue order within 4,096 prefill tokens a step.

The first --warmup seconds of arrivals are served but not measured, so that the host tier is
full and its buffers are reused as in a server that has run a while (on this VM the first touch of
fresh memory costs about 1.2 s a GB, which a long-running server has long paid).

Two engines run the same trace. The manager's: each step calls LoraManager.step, and a request
heard of while the forward runs is passed to prefetch at once. The baseline's, as vLLM does: a
request whose adapter is missing has it read and copied inside the step, on the engine thread,
before the forward. Both have the same host capacity and device slots.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import settle_writes

from mstar.engine.resources.lora import LoraAdapterStore, LoraDevicePool, specs_from_config
from mstar.engine.resources.lora.check import check_all
from mstar.engine.resources.lora.manager import LoraManager, Request
from mstar.engine.resources.lora.tools.samples import sample_modules, write_peft_adapter

LLAMA_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000}
RATE, ALPHA, FILES = 10.0, 1.0, 100
HOST, SLOTS, PREFILL_BUDGET = 128, 64, 4096


def step_seconds(prefill_tokens: int, decoding: int) -> float:
    return 0.012 + 0.0001 * prefill_tokens + 0.00012 * decoding


@dataclass
class Job:
    id: int
    arrival: float
    adapter: str
    prompt: int
    output: int
    first_token: float | None = None
    done: float | None = None
    failed: str | None = None


def trace(n: int, seconds: float, seed: int = 0) -> list[Job]:
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** ALPHA for i in range(n)]
    jobs, t = [], 0.0
    while True:
        t += rng.expovariate(RATE)
        if t > seconds:
            return jobs
        name = f"lora{rng.choices(range(n), weights)[0]}"
        jobs.append(Job(len(jobs), t, name, rng.randint(8, 512), rng.randint(8, 512)))


@dataclass
class Run:
    jobs: list[Job]
    steps: list[tuple[float, float, bool]] = field(default_factory=list)  # (start, seconds, waited on a read)


def serve(jobs: list[Job], admit, on_arrival=None, events=()) -> Run:
    """The engine loop: arrivals join the queue; each step admits, then the forward (asleep) runs,
    during which arrivals are heard of; then one token for every running request. events are
    (seconds, what to do then), done at the first step boundary after."""
    run, pending, waiting, running, events = Run(jobs), list(jobs), [], {}, sorted(events)
    t0 = time.monotonic()
    while pending or waiting or running:
        now = time.monotonic() - t0
        while events and events[0][0] <= now:
            events.pop(0)[1]()
        while pending and pending[0].arrival <= now:
            waiting.append(pending.pop(0))
        if not waiting and not running:
            time.sleep(max(0.0, pending[0].arrival - now))
            continue
        start = time.monotonic()
        admitted, failed, read_in_step = admit([j for j, _ in running.values()], waiting)
        for j in waiting:
            j.failed = failed.get(j.id)
        prefill, taken = 0, []
        for j in admitted:
            if prefill + j.prompt > PREFILL_BUDGET and taken:
                break
            prefill += j.prompt
            taken.append(j)
        taken_ids = {j.id for j in taken}
        waiting = [j for j in waiting if j.id not in taken_ids and j.id not in failed]
        end = time.monotonic() + step_seconds(prefill, len(running))
        while pending and t0 + pending[0].arrival < end:  # the forward runs; the host hears of arrivals
            time.sleep(max(0.0, t0 + pending[0].arrival - time.monotonic()))
            waiting.append(pending.pop(0))
            if on_arrival:
                on_arrival(waiting)
        time.sleep(max(0.0, end - time.monotonic()))
        now = time.monotonic() - t0
        run.steps.append((start - t0, time.monotonic() - start, read_in_step))
        for j in taken:
            j.first_token = now
            running[j.id] = [j, j.output - 1]
        for key in list(running):
            running[key][1] -= 1
            if running[key][1] <= 0:
                running.pop(key)[0].done = now
    return run


class ManagerEngine:
    def __init__(self, spec, paths: dict[str, str]) -> None:
        self.m = LoraManager({"language_model": LoraAdapterStore(spec, pin=False)},
                             {"language_model": LoraDevicePool(spec, SLOTS)}, read_workers=2)
        self.m.register_all(paths)
        self.engine_thread = threading.get_ident()
        self.reads_here = 0
        store = self.m.stores["language_model"]
        read = store.read

        def counted(*args, **kw):  # a read on the engine thread would stall the step
            self.reads_here += threading.get_ident() == self.engine_thread
            return read(*args, **kw)

        store.read = counted

    def admit(self, running: list[Job], waiting: list[Job]):
        before = self.reads_here
        step = self.m.step([Request(j.id, j.adapter) for j in running], [Request(j.id, j.adapter) for j in waiting])
        by_id = {j.id: j for j in waiting}
        return ([by_id[i] for i in step.admitted], {i: str(e) for i, e in step.failed.items()},
                self.reads_here > before)

    def on_arrival(self, waiting: list[Job]) -> None:
        self.m.prefetch([Request(j.id, j.adapter) for j in waiting])

    def counters(self) -> tuple[int, int, int]:
        c = self.m.counters
        return c.host_hits, c.host_misses, c.bytes_read


class InStepEngine:
    """The baseline: a missing adapter is read and copied inside the step, on the engine thread."""

    def __init__(self, spec, paths: dict[str, str], digests: dict[str, bytes]) -> None:
        self.store, self.pool = LoraAdapterStore(spec, pin=False), LoraDevicePool(spec, SLOTS)
        self.paths, self.digests = paths, digests
        self.hits = self.misses = self.bytes = 0
        self.seen: set[int] = set()

    def admit(self, running: list[Job], waiting: list[Job]):
        active = {j.adapter for j in running}
        admitted, failed, read = [], {}, False
        for j in waiting:
            if j.adapter not in active and len(active) >= SLOTS:
                continue
            self.store.hold(j.adapter, keep=active)
            if self.store.get(j.adapter) is None:
                read = True
                self.misses += j.id not in self.seen
                try:
                    adapter = self.store.read(j.adapter, self.paths[j.adapter], self.digests[j.adapter])
                except ValueError as e:
                    failed[j.id] = str(e)
                    continue
                self.store.put(adapter)
                self.bytes += adapter.nbytes
            else:
                self.hits += j.id not in self.seen
            self.seen.add(j.id)
            self.pool.activate(self.store.get(j.adapter), keep=active | {j.adapter})
            active.add(j.adapter)
            admitted.append(j)
        return admitted, failed, read

    def counters(self) -> tuple[int, int, int]:
        return self.hits, self.misses, self.bytes


def figures(run: Run, warmup: float) -> dict[str, float]:
    """The figures of the requests that arrived after the warm-up and of the steps from then on."""
    measured = [j for j in run.jobs if j.arrival >= warmup]
    served = [j for j in measured if j.failed is None]
    ttft = sorted(j.first_token - j.arrival for j in served)
    steps = [s for s in run.steps if s[0] >= warmup]
    p99 = sorted(d for _, d, _ in steps)
    return {"throughput": len(served) / (max(j.done for j in served) - warmup), "ttft_mean": statistics.mean(ttft),
            "ttft_p99": ttft[int(0.99 * (len(ttft) - 1))], "step_p99": p99[int(0.99 * (len(p99) - 1))],
            "failed": len(measured) - len(served), "waited": sum(w for _, _, w in steps),
            "failed_adapters": {j.adapter for j in measured if j.failed is not None}}


def write_files(root: Path, spec) -> list[Path]:
    files = []
    for i in range(FILES):
        modules = sample_modules(spec, 8, seed=i, targets=("qkv_proj", "o_proj"))
        files.append(write_peft_adapter(root / f"f{i}", modules, alpha=16))
    return files


def run_one(kind: str, spec, paths: dict[str, str], jobs: list[Job], warmup: float, events=(),
            ) -> tuple[dict, float, int]:
    """One engine through the trace: its figures after the warm-up, its host hit rate and bytes read then."""
    gc.collect()
    engine = ManagerEngine(spec, paths) if kind == "manager" else InStepEngine(spec, paths, check_all(spec, paths))
    at_warmup: list[tuple[int, int, int]] = []
    run = serve([Job(j.id, j.arrival, j.adapter, j.prompt, j.output) for j in jobs], engine.admit,
                engine.on_arrival if kind == "manager" else None,
                [*((t, lambda fn=fn: fn(engine)) for t, fn in events),
                 (warmup, lambda: at_warmup.append(engine.counters()))])
    (h0, m0, b0), (h1, m1, b1) = at_warmup[0], engine.counters()
    if kind == "manager":
        engine.m.close()
    return figures(run, warmup), (h1 - h0) / max(1, h1 - h0 + m1 - m0), b1 - b0


def row(n, kind: str, f: dict, hit: float, read: int) -> str:
    return (f"{n:<7} {kind:8} {f['throughput']:5.2f}  {f['ttft_mean'] * 1e3:7.1f} ms {f['ttft_p99'] * 1e3:7.1f} ms "
            f"{f['step_p99'] * 1e3:6.1f} ms  {f['waited']:>23}  {hit:8.1%}  {read / 1e9:7.2f}  {f['failed']:>6}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0, help="arrivals measured")
    ap.add_argument("--warmup", type=float, default=20.0, help="arrivals served first, not measured")
    ap.add_argument("--adapters", type=int, nargs="+", default=[5, 100, 1000, 2000])
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())
    atexit.register(shutil.rmtree, root, True)
    spec = specs_from_config(LLAMA_7B, max_rank=8, capacity=HOST)["language_model"]
    files = write_files(root, spec)
    settle_writes()
    size = (files[0] / "adapter_model.safetensors").stat().st_size
    print(f"{args.warmup:.0f} s of arrivals to warm up, then {args.seconds:.0f} s measured, at {RATE:.0f} req/s; "
          f"host capacity {HOST}, device slots {SLOTS}; adapter {size / 1e6:.1f} MB")
    print("n       engine   req/s  TTFT mean  TTFT p99  step p99  steps waiting on a read  host hits  GB read  failed")
    results = {}
    for n in args.adapters:
        paths = {f"lora{i}": str(files[i % FILES]) for i in range(n)}
        jobs = trace(n, args.warmup + args.seconds)
        for kind in ("manager", "in-step"):
            results[n, kind] = run_one(kind, spec, paths, jobs, args.warmup)
            print(row(n, kind, *results[n, kind]))
    n = max(args.adapters)
    paths = {f"lora{i}": str(files[i % FILES]) for i in range(n)}
    broken: list[Path] = []

    def vanish(engine: ManagerEngine) -> None:
        """1 of the 100 files gone: the one whose names not in host memory now draw the most requests,
        so that reads of it fail (names already in keep being served from their checked copies)."""
        held = {k.split("@")[0] for k in engine.m.stores["language_model"].held()}
        weight = [sum(1 / (i + 1) ** ALPHA for i in range(f, n, FILES) if f"lora{i}" not in held)
                  for f in range(FILES)]
        broken.append(files[max(range(FILES), key=weight.__getitem__)] / "adapter_model.safetensors")
        os.rename(broken[0], broken[0].with_suffix(".gone"))

    f, hit, read = run_one("manager", spec, paths, trace(n, args.warmup + args.seconds), args.warmup,
                           [(args.warmup + args.seconds / 3, vanish)])
    os.rename(broken[0].with_suffix(".gone"), broken[0])
    gone = files.index(broken[0].parent)
    all_theirs = all(int(a.removeprefix("lora")) % FILES == gone for a in f["failed_adapters"])
    print(row(f"{n}-1%", "manager", f, hit, read))
    lo, hi = min(args.adapters), max(args.adapters)
    if lo != hi:
        a, b = results[lo, "manager"][0], results[hi, "manager"][0]
        print(f"manager, n={hi} vs n={lo}: throughput {b['throughput'] / a['throughput']:.1%} (target >= 98%), "
              f"mean TTFT {b['ttft_mean'] / a['ttft_mean']:.2f}x (target <= 1.2x)")
    whole = results[hi, "manager"][0]
    print(f"n={hi} with 1% of the files gone a third of the way in: {f['failed']} requests failed (all naming "
          f"{broken[0].parent.name}'s adapters: {all_theirs}); throughput "
          f"{f['throughput'] / whole['throughput']:.1%}, mean TTFT {f['ttft_mean'] / whole['ttft_mean']:.2f}x, "
          f"step p99 {f['step_p99'] / whole['step_p99']:.2f}x of the run without (target: within 5%)")


if __name__ == "__main__":
    main()
