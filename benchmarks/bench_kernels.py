"""LoRA's time as a share of the base layer's GEMM: the Triton kernels beside a gather-then-bmm baseline and the
reference op, for Llama-3-8B-shaped q/k/v/o and gate/up/down; and activation against a pinned memcpy.

Run on a GPU: .venv/bin/python benchmarks/bench_kernels.py [--json FILE]   (scripts/gpu-check.sh runs it)
On the CPU:   .venv/bin/python benchmarks/bench_kernels.py --tiny          (tiny shapes under Triton's interpreter,
              to check that it runs: its times say nothing)

One decoder layer's four targets per case; every figure is the median of 11 interleaved runs in one process. On a
GPU the base GEMM, the kernels and the baseline are timed as CUDA graph replays (an engine captures its decode
steps, and Python's launch cost would otherwise be what is measured); the reference op synchronises with the host
per slot, so it runs eagerly. The pool's slabs are filled in place as activation leaves them: each slot's rank r
of max_rank R, zero past it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the kernels then run under Triton's interpreter, chosen before its import
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))
from mstar.engine.resources.lora import LoraDevicePool, add_lora, specs_from_config
from mstar.engine.resources.lora.batch import LoraBatch
from mstar.engine.resources.lora.models import load_config

TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
GATHER_LIMIT = 4 << 30  # bytes the baseline may gather per target; past it the row says n/a
REPEAT = 11


def llama8b(layers: int = 1) -> dict:
    return {**load_config("llama-3.1-8b"), "num_hidden_layers": layers}


TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128}


def filled_pool(config: dict, max_rank: int, ranks: list[int], device: str) -> LoraDevicePool:
    """A pool of len(ranks) slots, slot i holding a random adapter of rank ranks[i] on every target."""
    spec = specs_from_config(config, max_rank=max_rank)["language_model"]
    pool = LoraDevicePool(spec, len(ranks), device, dtype=torch.bfloat16 if device == "cuda" else torch.float16)
    g = torch.Generator(device).manual_seed(0)
    R = max_rank
    for name, t in pool.layout.targets.items():
        a, b = pool.a[name], pool.b[name]
        for slot, r in enumerate(ranks):
            for s in range(t.target.slices):
                rows = a[slot, :, s * R : s * R + r]
                rows.copy_(torch.randn(rows.shape, generator=g, device=device) * 0.02)
                cols = b[slot, :, t.b_rows(s), :r]
                cols.copy_(torch.randn(cols.shape, generator=g, device=device) * 0.02)
        pool.ranks[name][:] = torch.tensor(ranks, dtype=torch.int32, device=device)[:, None, None]
    pool.scaling.fill_(2.0)
    return pool


def token_slots(tokens: int, adapters: int, prefill: bool, device: str) -> torch.Tensor:
    """Decode: the adapters spread over the batch in a shuffled order; prefill: one run of tokens per adapter."""
    if prefill:
        return (torch.arange(tokens, device=device) * adapters // tokens).to(torch.int64)
    g = torch.Generator().manual_seed(tokens * 1000 + adapters)
    return (torch.arange(tokens) % adapters)[torch.randperm(tokens, generator=g)].to(device)


def gather_bmm(out: torch.Tensor, x: torch.Tensor, pool: LoraDevicePool, target: str, slots: torch.Tensor) -> None:
    """The baseline: every token's A and B gathered (padded to R), then batched products."""
    t = pool.layout.targets[target]
    s = slots.clamp(min=0)
    a, b = pool.a[target][s, 0], pool.b[target][s, 0]
    h = torch.bmm(x[:, None, :], a.transpose(1, 2))  # [tokens, 1, slices * R]
    parts = [torch.bmm(h[:, :, t.a_rows(q)], b[:, t.b_rows(q)].transpose(1, 2)) for q in t.target.covered(None)]
    out += (torch.cat(parts, 2)[:, 0] * (pool.scaling[s] * (slots >= 0))[:, None]).to(out.dtype)


def gather_bytes(pool: LoraDevicePool, tokens: int) -> int:
    return max((pool.a[n][0, 0].numel() + pool.b[n][0, 0].numel()) * tokens * 2 for n in TARGETS)


class Case:
    """One layer's four targets at one batch: inputs, base weights, outputs, and each method as a callable."""

    def __init__(self, pool: LoraDevicePool, tokens: int, slots: torch.Tensor, device: str) -> None:
        dtype = pool.dtype
        self.pool, self.slots = pool, slots
        self.batch = LoraBatch.build(slots, pool.slots)
        layouts = pool.layout.targets
        self.x = {n: torch.randn(tokens, layouts[n].a_shape[2], device=device, dtype=dtype) for n in TARGETS}
        self.w = {n: torch.randn(sum(layouts[n].shard.widths()), layouts[n].a_shape[2], device=device, dtype=dtype)
                  * 0.02 for n in TARGETS}
        self.out = {n: torch.zeros(tokens, self.w[n].shape[0], device=device, dtype=dtype) for n in TARGETS}

    def check(self) -> None:
        """The kernels' delta is the reference's, so what is timed is right."""
        for n in TARGETS:
            got, want = torch.zeros_like(self.out[n]), torch.zeros_like(self.out[n])
            add_lora(got, self.x[n], self.pool, n, 0, self.batch, backend="triton")
            add_lora(want, self.x[n], self.pool, n, 0, self.slots, backend="torch")
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3, msg=lambda m, n=n: f"{n}: {m}")

    def base(self) -> None:
        for n in TARGETS:
            torch.nn.functional.linear(self.x[n], self.w[n], out=self.out[n])

    def triton(self) -> None:
        for n in TARGETS:
            add_lora(self.out[n], self.x[n], self.pool, n, 0, self.batch, backend="triton")

    def gather(self) -> None:
        for n in TARGETS:
            gather_bmm(self.out[n], self.x[n], self.pool, n, self.slots)

    def reference(self) -> None:
        for n in TARGETS:
            add_lora(self.out[n], self.x[n], self.pool, n, 0, self.slots, backend="torch")


def timed(fns: dict[str, callable], cuda: bool, graphs: set[str]) -> dict[str, float]:
    """Each function's median seconds over REPEAT interleaved runs; those in graphs as CUDA graph replays (ten a
    run), the rest eagerly."""
    runs = {}
    for name, fn in fns.items():
        fn()  # compiles kernels, builds tables
        if cuda and name in graphs:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            runs[name] = (graph.replay, 10, graph)
        else:
            runs[name] = (fn, 1, None)
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(REPEAT):
        for name, (fn, inner, _) in runs.items():
            if cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(inner):
                    fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3 / inner)
            else:
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    return {n: statistics.median(v) for n, v in times.items()}


def run_case(config, device, tokens, adapters, rank, max_rank, prefill, reference=True) -> dict:
    cuda = device == "cuda"
    pool = filled_pool(config, max_rank, [rank] * adapters, device)
    case = Case(pool, tokens, token_slots(tokens, adapters, prefill, device), device)
    case.check()
    fns = {"base": case.base, "triton": case.triton}
    if gather_bytes(pool, tokens) <= GATHER_LIMIT:
        fns["gather_bmm"] = case.gather
    if reference:
        fns["reference"] = case.reference
    t = timed(fns, cuda, graphs={"base", "triton", "gather_bmm"})
    row = {"tokens": tokens, "adapters": adapters, "rank": rank, "max_rank": max_rank,
           "shape": "prefill" if prefill else "decode", **{f"{k}_us": v * 1e6 for k, v in t.items()}}
    del case, pool
    if cuda:
        torch.cuda.empty_cache()
    return row


def lora_bytes_share(config: dict, adapters: int, rank: int) -> float:
    """What the LoRA of so many distinct adapters must read against what the base GEMM reads, at decode: the floor
    of its share of the base's time where both are bound by memory bandwidth."""
    spec = specs_from_config(config, max_rank=rank)["language_model"]
    lora = base = 0
    for n in TARGETS:
        t = spec.targets[n]
        lora += adapters * rank * (t.slices * t.in_features + sum(t.out_features))
        base += t.in_features * sum(t.out_features)
    return lora / base


def activation(device: str) -> dict:
    """An 8B-shaped rank-16 adapter (all 7 linears, 32 layers) activated from pinned memory vs one pinned copy."""
    import shutil
    import tempfile

    from common import write_adapters

    from mstar.engine.resources.lora.store import LoraAdapterStore

    root = Path(tempfile.mkdtemp())
    try:
        large, _ = write_adapters(root)
        spec = specs_from_config("llama-3.1-8b", max_rank=16)["language_model"]
        adapter = LoraAdapterStore(spec, pin=True).read("large", large)
        pool = LoraDevicePool(spec, 2, device)
        host = torch.empty(adapter.nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(adapter.nbytes, dtype=torch.uint8, device=device)

        def activate():
            pool.deactivate("large")
            pool.activate(adapter)
            torch.cuda.synchronize()

        def memcpy():
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()

        t = timed({"activate": activate, "memcpy": memcpy}, cuda=False, graphs=set())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"bytes": adapter.nbytes, "activate_ms": t["activate"] * 1e3, "memcpy_ms": t["memcpy"] * 1e3,
            "of_memcpy": t["memcpy"] / t["activate"]}


def cases(tiny: bool) -> list[tuple]:
    """(tokens, adapters, rank, max_rank, prefill) per row."""
    if tiny:
        return [(8, 3, 4, 8, False), (64, 2, 8, 8, True)]
    decode = [(t, d, 16, 64, False) for t in (1, 16, 64, 256) for d in (1, 8, 64) if d <= t]
    prefill = [(t, d, 16, 64, True) for t in (512, 2048, 8192) for d in (1, 8, 64)]
    ranks = [(64, 64, r, 64, False) for r in (8, 32, 64)] + [(64, 64, 8, 8, False)]
    ranks += [(2048, 8, r, 64, True) for r in (8, 32, 64)] + [(2048, 8, 8, 8, True)]
    return decode + prefill + ranks


def table(rows: list[dict]) -> str:
    lines = ["| shape | tokens | adapters | rank / max_rank | base GEMMs | triton | gather+bmm | reference |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = r["base_us"]

        def share(k, base=base, r=r):
            return f"{r[k]:.1f} µs ({100 * r[k] / base:.1f}%)" if k in r else "n/a"

        lines.append(f"| {r['shape']} | {r['tokens']} | {r['adapters']} | {r['rank']} / {r['max_rank']} | "
                     f"{base:.1f} µs | {share('triton_us')} | {share('gather_bmm_us')} | {share('reference_us')} |")
    return "\n".join(lines)


def verdicts(rows: list[dict], act: dict | None, config: dict) -> list[tuple[str, str, str]]:
    """(check, measured, target) for the issue's three targets."""
    def find(**k):
        return next(r for r in rows if all(r[a] == b for a, b in k.items()))

    out = []
    d = find(shape="decode", tokens=64, adapters=64, rank=16, max_rank=64)
    floor = lora_bytes_share(config, 64, 16)
    out.append(("LoRA / base GEMMs, decode 64 tokens, 64 distinct rank-16 adapters",
                f"{100 * d['triton_us'] / d['base_us']:.1f}% (bytes alone: >= {100 * floor:.0f}%)", "<= 5%"))
    for shape, tokens, adapters in (("decode", 64, 64), ("prefill", 2048, 8)):
        wide, narrow = (find(shape=shape, tokens=tokens, adapters=adapters, rank=8, max_rank=m) for m in (64, 8))
        out.append((f"rank 8 in max_rank 64 vs max_rank 8, {shape} {tokens} tokens",
                    f"{wide['triton_us'] / narrow['triton_us']:.2f}x", "<= 1.3x"))
    if act:
        out.append((f"activation vs pinned memcpy of {act['bytes'] / 1e6:.1f} MB",
                    f"{act['of_memcpy']:.2f} of its bandwidth ({act['activate_ms']:.2f} vs {act['memcpy_ms']:.2f} ms)",
                    ">= 0.8"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes, on the CPU under Triton's interpreter")
    p.add_argument("--json", type=Path, help="write the rows and verdicts here")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        p.error("without CUDA only --tiny runs (the kernels under Triton's interpreter)")
    if device == "cpu":
        torch.set_num_threads(1)
    config = TINY if args.tiny else llama8b()
    rows = []
    for tokens, adapters, rank, max_rank, prefill in cases(args.tiny):
        rows.append(run_case(config, device, tokens, adapters, rank, max_rank, prefill))
        print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    print(table(rows))
    act = activation(device) if device == "cuda" else None
    checks = [] if args.tiny else verdicts(rows, act, config)
    for check, measured, target in checks:
        print(f"{check}: {measured} (target {target})")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "activation": act, "checks": checks}, indent=1))


if __name__ == "__main__":
    main()
