"""Host tier speed: inspect and read, side by side with what they must keep up with.

Run: .venv/bin/python benchmarks/bench_host.py
Every figure is a ratio of medians (11 interleaved runs) from one run, page cache warm, so the
machine's noise cancels out. "cold" is a header never seen before; "warm" one seen before, as for
the second and later adapters of one training recipe (byte-identical headers), or a re-read after
an eviction. With --main SRC (a src folder of main's code), main's reads run side by side in the
same process (its package copied as mstar_main, bench_experts.main_package).
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import sys
import tempfile
from pathlib import Path

import blake3
import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_experts import main_package
from common import Memcpy, cold, llama8b_spec, ms, side_by_side, status_kb, verdict, write_adapters

from mstar.engine.resources.lora.store import LoraAdapterStore, check_adapter_file, inspect_adapter
from mstar.engine.resources.lora.tools.samples import sample_modules, write_peft_adapter


class LoadFileAndCopy:
    """safetensors' load_file, then a copy of every tensor into memory the caller already holds: the
    least an engine does to keep a copy of its own."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.dst = {k: torch.empty_like(v) for k, v in safetensors.torch.load_file(file).items()}

    def __call__(self) -> None:
        for k, v in safetensors.torch.load_file(self.file).items():
            self.dst[k].copy_(v)


def raw_hash(file: Path) -> bytes:
    return blake3.blake3(max_threads=blake3.blake3.AUTO).update_mmap(file).digest()


def main_reads(src: str, root: Path, large: Path) -> dict:
    """main's reads of large, as the figures below time this branch's, named "main ..."."""
    theirs = main_package(src, root)
    spec = theirs.specs_from_config("llama-3.1-8b", max_rank=16)["language_model"]
    digest = theirs.check_adapter_file(spec, "large", large)
    ws1, ws8 = theirs.LoraAdapterStore(spec, pin=False), theirs.LoraAdapterStore(spec, rank=3, world_size=8, pin=False)

    def cold_read():
        theirs.safetensors_header._HEADERS.clear()
        return ws1.read("large", large)

    return {"main read cold": cold_read, "main read warm": lambda: ws1.read("large", large),
            "main read+digest warm": lambda: ws1.read("large", large, digest),
            "main ws8 warm": lambda: ws8.read("large", large),
            "main ws8+digest warm": lambda: ws8.read("large", large, digest)}


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args.add_argument("--main", metavar="SRC", help="main's src folder, read side by side")
    args = args.parse_args()
    torch.set_num_threads(1)  # one reader thread, as an engine's loader would use
    root = Path(tempfile.mkdtemp())  # removed at exit
    atexit.register(shutil.rmtree, root, True)
    large, small = write_adapters(root)
    file = large / "adapter_model.safetensors"
    size = file.stat().st_size
    spec = llama8b_spec()
    print(f"adapter: {size / 1e6:.1f} MB (Llama-3-8B shape, 32 layers, 7 linears, r=16, bf16); small: "
          f"{(small / 'adapter_model.safetensors').stat().st_size / 1e6:.2f} MB (7 modules)")

    t = side_by_side({"large cold": cold(lambda: inspect_adapter(spec, large)),
                      "large warm": lambda: inspect_adapter(spec, large),
                      "small cold": cold(lambda: inspect_adapter(spec, small)),
                      "small warm": lambda: inspect_adapter(spec, small)}, repeat=15)
    for k in ("cold", "warm"):
        print(f"inspect_adapter {k}: 224 modules {ms(t['large ' + k])}, 7 modules {ms(t['small ' + k])} -> "
              f"{t['large ' + k] / t['small ' + k]:.2f}x: the time follows the header's length")

    digest = check_adapter_file(spec, "large", large)
    ws1 = LoraAdapterStore(spec, pin=False)
    ws8 = LoraAdapterStore(spec, rank=3, world_size=8, pin=False)
    t = side_by_side({
        "read cold": cold(lambda: ws1.read("large", large)),
        "read warm": lambda: ws1.read("large", large),
        "read+digest cold": cold(lambda: ws1.read("large", large, digest)),
        "read+digest warm": lambda: ws1.read("large", large, digest),
        "ws8 cold": cold(lambda: ws8.read("large", large)),
        "ws8 warm": lambda: ws8.read("large", large),
        "ws8+digest warm": lambda: ws8.read("large", large, digest),
        "check cold": cold(lambda: check_adapter_file(spec, "large", large)),
        "check warm": lambda: check_adapter_file(spec, "large", large),
        "memcpy": Memcpy(file),
        "load_file+copy": LoadFileAndCopy(file),
        "hash": lambda: raw_hash(file),
        **(main_reads(args.main, root, large) if args.main else {}),
    })
    print(f"baselines: memcpy of the file's bytes {ms(t['memcpy'])}; load_file + copy {ms(t['load_file+copy'])}; "
          f"BLAKE3 of the file on every core {ms(t['hash'])} ({size / t['hash'] / 1e9:.1f} GB/s)")
    for k in ("cold", "warm"):
        read = t[f"read {k}"]
        print(f"read, world size 1, {k}: {ms(read)} = {size / read / 1e9:.1f} GB/s -> vs memcpy "
              f"{verdict(read / t['memcpy'], 1.25)}, vs load_file + copy {verdict(read / t['load_file+copy'], 0.6)}")
        with_digest = t[f"read+digest {k}"]
        print(f"read with digest, {k}: {ms(with_digest)} -> vs read {verdict(with_digest / read, 1.5)}; vs BLAKE3 "
              f"of the file alone {with_digest / t['hash']:.2f}x")
        print(f"read, rank 3 of 8, {k}: {ms(t[f'ws8 {k}'])} -> vs world size 1 {verdict(t[f'ws8 {k}'] / read, 0.5)}")
        if k == "warm":
            print(f"read with digest, rank 3 of 8, warm: {ms(t['ws8+digest warm'])} -> vs world size 1 with digest "
                  f"{verdict(t['ws8+digest warm'] / with_digest, 0.6)}")
        if args.main:
            theirs = t[f"main read {k}"]
            print(f"main's read, world size 1, {k}: {ms(theirs)} -> vs memcpy {theirs / t['memcpy']:.2f}x; this "
                  f"branch's {read / theirs:.2f}x main's")
        if args.main and k == "warm":
            theirs, mine = t["main ws8+digest warm"], t["ws8+digest warm"]
            print(f"main's read with digest, rank 3 of 8, warm: {ms(theirs)} -> vs its world size 1 with digest "
                  f"{theirs / t['main read+digest warm']:.2f}x; this branch's {mine / theirs:.2f}x main's")
        print(f"check_adapter_file, {k}: {ms(t[f'check {k}'])} -> throughput vs BLAKE3 alone "
              f"{verdict(t['hash'] / t[f'check {k}'], 0.8, at_least=True)}")

    fresh = LoraAdapterStore(spec, pin=False)  # no spare buffer to reuse
    anon0, hwm0 = status_kb("RssAnon"), status_kb("VmHWM")
    adapter = fresh.read("large", large, digest)
    anon1, hwm1 = status_kb("RssAnon"), status_kb("VmHWM")
    print(f"memory: layout {adapter.nbytes / 1e6:.1f} MB; anonymous resident memory added by one read into a new "
          f"store {(anon1 - anon0) / 1e3:.1f} MB; peak resident (VmHWM) rose {(hwm1 - hwm0) / 1e3:.1f} MB")
    thin = write_peft_adapter(root / "thin", sample_modules(spec, 4, dtype=torch.bfloat16), alpha=8)
    padded = LoraAdapterStore(spec, pin=False)
    t = side_by_side({"r4": lambda: padded.read("thin", thin), "memcpy": Memcpy(file)})
    print(f"read of the same adapter at r=4, padded to max_rank 16: {ms(t['r4'])}; memcpy of as many bytes as its "
          f"layout {ms(t['memcpy'])} -> {t['r4'] / t['memcpy']:.2f}x (its file is a quarter of its layout)")


if __name__ == "__main__":
    main()
