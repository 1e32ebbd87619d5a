"""The startup check of a deployment of 1,000 adapters against BLAKE3 alone over the same bytes.

Run: .venv/bin/python benchmarks/bench_startup.py [--adapters 1000] [--main-src /tmp/main-ref/src]
The adapters are generated for a Llama-3.2-1B-shaped model in eight recipes (ranks 4 to 32, from
q/v only to all seven linears), so adapters of one recipe share a header, as a deployment's do.
Both sides use every core: check_adapters on its worker threads, BLAKE3 hashing the files on as
many threads, each file on one (the faster of that and one file at a time on every core is taken).
Beside them: the same files read with os.preadv into a buffer and hashed there, one thread a file (what
a check that maps nothing could cost at least), and, with --main-src, another checkout's check_adapters
loaded in this process under another name, timed in the same rounds.
Each run's CPU time (every thread's) is shown too: load from other processes stretches wall times, not work.
Memory is read as resident anonymous memory after checking the first tenth and after all of them.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
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


def read_and_hash_all(files: list[Path], threads: int, block: int = 256 << 10) -> None:
    """Each file read with os.preadv into a buffer of its thread's and hashed there, one thread a file."""
    buffers = {}

    def one(f: Path) -> bytes:
        buf = buffers.setdefault(threading.get_ident(), memoryview(mmap.mmap(-1, block)))
        h, fd = blake3.blake3(max_threads=1), os.open(f, os.O_RDONLY)
        try:
            at, size = 0, os.fstat(fd).st_size
            while at < size:
                got = os.preadv(fd, [buf], at)
                h.update(buf[:got])
                at += got
        finally:
            os.close(fd)
        return h.digest()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, files))


def load_lora(src: str):
    """The lora package of another checkout (its src folder), loaded under another name beside this one."""
    where = Path(src) / "mstar" / "engine" / "resources" / "lora"
    spec = importlib.util.spec_from_file_location("lora_main", where / "__init__.py",
                                                  submodule_search_locations=[str(where)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["lora_main"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--main-src", help="another checkout's src folder, whose check_adapters is timed alongside")
    args = ap.parse_args()
    n = args.adapters
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
    fns = {"check": lambda: check_adapters(spec), "hash per file": lambda: hash_all(files, cores, 1),
           "hash every core": lambda: hash_all(files, 1, blake3.blake3.AUTO),
           "read and hash": lambda: read_and_hash_all(files, cores)}
    if args.main_src:
        other = load_lora(args.main_src)
        other_spec = other.specs_from_config(LLAMA_1B, max_rank=32, adapters=paths)["language_model"]
        assert other.check_adapters(other_spec) == check_adapters(spec), "the two checkouts' digests differ"
        fns["main's check"] = lambda: other.check_adapters(other_spec)
    times: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(9):
        for name, fn in fns.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    anon_all = status_kb("RssAnon")
    med = {k: statistics.median(v) for k, v in times.items()}
    raw = min(med["hash per file"], med["hash every core"])
    print(f"check_adapters: {med['check']:.3f} s = {total / med['check'] / 1e9:.2f} GB/s; BLAKE3 alone: "
          f"{med['hash per file']:.3f} s one file per core, {med['hash every core']:.3f} s one file at a time on every "
          f"core -> throughput {verdict(raw / med['check'], 0.9, at_least=True)} (medians of 9)")
    floor, theirs = med["read and hash"], med.get("main's check")
    print(f"read with preadv and hashed, one thread a file: {floor:.3f} s ({raw / floor:.2f}x BLAKE3 alone); "
          f"check_adapters at {floor / med['check']:.2f}x its throughput")
    if theirs is not None:
        print(f"main's check_adapters: {theirs:.3f} s ({raw / theirs:.2f}x BLAKE3 alone); this one at "
              f"{theirs / med['check']:.2f}x its throughput")
    work = {k: statistics.median(v) for k, v in cpu.items()}
    print("CPU seconds a run (every thread; what load does not stretch): "
          + ", ".join(f"{k} {v:.3f}" for k, v in work.items())
          + f" -> check_adapters' work {min(work['hash per file'], work['hash every core']) / work['check']:.2f}x "
          "BLAKE3 alone's")
    print(f"memory: resident anonymous {anon_tenth / 1e3:.1f} MB after checking {n // 10} adapters, "
          f"{anon_all / 1e3:.1f} MB after checking all {n} nine more times ({(anon_all - anon_tenth) / 1e3:+.1f} MB)")
    print(f"digests: {len(check_adapters(spec))} of {n}")


if __name__ == "__main__":
    main()
