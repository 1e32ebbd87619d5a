"""Shared pieces of the benchmarks: the Llama-3-8B-shaped adapter, timing, memory readings."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mstar.engine.resources.lora import safetensors_header
from mstar.engine.resources.lora.models import specs_from_config
from mstar.engine.resources.lora.tools.samples import sample_modules, write_peft_adapter


def llama8b_spec(max_rank: int = 16, **kw):
    return specs_from_config("llama-3.1-8b", max_rank=max_rank, **kw)["language_model"]


def write_adapters(root: Path) -> tuple[Path, Path]:
    """The 8B-shaped r=16 bf16 adapter (all 7 linears, 32 layers, about 84 MB) and a 1 MB one."""
    spec = llama8b_spec()
    large = write_peft_adapter(root / "large", sample_modules(spec, 16, dtype=torch.bfloat16), alpha=32)
    small = write_peft_adapter(root / "small", sample_modules(spec, 6, dtype=torch.bfloat16, layers=range(1)),
                               alpha=12)
    settle_writes()
    return large, small


class Memcpy:
    """A plain copy of the file's bytes, already in memory, into memory already faulted."""

    def __init__(self, file: Path) -> None:
        self.src = torch.frombuffer(bytearray(file.read_bytes()), dtype=torch.uint8)
        self.dst = torch.zeros_like(self.src)

    def __call__(self) -> None:
        self.dst.copy_(self.src)


def settle_writes() -> None:
    """Files just written are flushed before anything is timed: their writeback would otherwise run,
    disk and CPU, beside the first measurements (it made reads of 16.8 MB take 27 ms, not 3)."""
    os.sync()


def side_by_side(fns: dict[str, Callable[[], object]], repeat: int = 11) -> dict[str, float]:
    """Each function's median time over repeat runs, the runs interleaved so drift hits all of them alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def cold(fn: Callable[[], object]) -> Callable[[], object]:
    """fn with the header caches emptied first: a header never seen."""
    def run():
        safetensors_header._HEADERS.clear()
        return fn()
    return run


def aside(fn: Callable[[], object]) -> Callable[[], object]:
    """cold(fn), then the header cache put back as it was: a warm run after it still finds the header its reads
    planned on (a check between them would otherwise leave its own parse, inspected but never planned)."""
    def run():
        cache = safetensors_header._HEADERS
        with cache._lock:
            saved = cache._headers.copy(), cache.nbytes
        cache.clear()
        try:
            return fn()
        finally:
            with cache._lock:
                cache._headers, cache.nbytes = saved
    return run


def ms(t: float) -> str:
    return f"{t * 1e3:.2f} ms"


def verdict(ratio: float, target: float, at_least: bool = False) -> str:
    met = ratio >= target if at_least else ratio <= target
    return f"{ratio:.2f}x (target {'>=' if at_least else '<='} {target}x: {'met' if met else 'NOT met'})"


def status_kb(field: str) -> int:
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0
