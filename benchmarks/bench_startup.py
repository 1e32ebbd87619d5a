"""The startup check of a deployment of 1,000 adapters against BLAKE3 alone over the same bytes.

Run: .venv/bin/python benchmarks/bench_startup.py [--adapters 1000]
The adapters are generated for a Llama-3.2-1B-shaped model in eight recipes (ranks 4 to 32, from
q/v only to all seven linears), so adapters of one recipe share a header, as a deployment's do.
Both sides use every core: check_adapters on its worker threads, BLAKE3 hashing the files on as
many threads, each file on one (the faster of that and one file at a time on every core is taken).
Memory is read as resident anonymous memory after checking the first tenth and after all of them.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3

sys.path.insert(0, str(Path(__file__).parent))
from common import settle_writes, status_kb, verdict

from mstar.engine.resources.lora import check_adapters, specs_from_config
from mstar.engine.resources.lora.tools.samples import DECODER_MODULES, sample_modules, write_peft_adapter

LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256}
ALL = tuple(DECODER_MODULES)
RECIPES = [(4, ALL), (8, ALL), (16, ("qkv_proj", "o_proj")), (32, ("qkv_proj",)), (8, ("qkv_proj", "o_proj")),
           (16, ("gate_up_proj", "down_proj")), (4, ("qkv_proj", "o_proj")), (32, ("o_proj", "down_proj"))]


def write(root: Path, n: int) -> dict[str, str]:
    spec = specs_from_config(LLAMA_1B, max_rank=32)["language_model"]
    templates = [sample_modules(spec, r, seed=i, targets=targets) for i, (r, targets) in enumerate(RECIPES)]
    paths = {}
    for i in range(n):
        modules = {m: (a + i * 1e-3, b - i * 1e-3) for m, (a, b) in templates[i % len(RECIPES)].items()}
        paths[f"a{i:04d}"] = str(write_peft_adapter(root / f"a{i:04d}", modules, alpha=16))
    return paths


def hash_all(files: list[Path], threads: int, per_file: int) -> None:
    def one(f: Path) -> bytes:
        return blake3.blake3(max_threads=per_file).update_mmap(f).digest()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, files))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", type=int, default=1000)
    n = ap.parse_args().adapters
    root = Path(tempfile.mkdtemp())  # removed at exit
    atexit.register(shutil.rmtree, root, True)
    t = time.perf_counter()
    paths = write(root, n)
    settle_writes()
    files = [Path(p) / "adapter_model.safetensors" for p in paths.values()]
    total = sum(f.stat().st_size for f in files)
    print(f"{n} adapters in {len(RECIPES)} recipes, {total / 1e9:.2f} GB, written in {time.perf_counter() - t:.0f} s; "
          f"{os.cpu_count()} cores")
    spec = specs_from_config(LLAMA_1B, max_rank=32, adapters=paths)["language_model"]
    first = specs_from_config(LLAMA_1B, max_rank=32, adapters=dict(list(paths.items())[: n // 10]))["language_model"]
    hash_all(files, 1, blake3.blake3.AUTO)  # page cache warm
    check_adapters(first)
    anon_tenth = status_kb("RssAnon")
    cores = os.cpu_count() or 1
    times: dict[str, list[float]] = {"check": [], "hash per file": [], "hash every core": []}
    for _ in range(9):
        for name, fn in (("check", lambda: check_adapters(spec)),
                         ("hash per file", lambda: hash_all(files, cores, 1)),
                         ("hash every core", lambda: hash_all(files, 1, blake3.blake3.AUTO))):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    anon_all = status_kb("RssAnon")
    med = {k: statistics.median(v) for k, v in times.items()}
    raw = min(med["hash per file"], med["hash every core"])
    print(f"check_adapters: {med['check']:.3f} s = {total / med['check'] / 1e9:.2f} GB/s; BLAKE3 alone: "
          f"{med['hash per file']:.3f} s one file per core, {med['hash every core']:.3f} s one file at a time on every "
          f"core -> throughput {verdict(raw / med['check'], 0.8, at_least=True)} (medians of 9)")
    print(f"memory: resident anonymous {anon_tenth / 1e3:.1f} MB after checking {n // 10} adapters, "
          f"{anon_all / 1e3:.1f} MB after checking all {n} nine more times ({(anon_all - anon_tenth) / 1e3:+.1f} MB)")
    print(f"digests: {len(check_adapters(spec))} of {n}")


if __name__ == "__main__":
    main()
