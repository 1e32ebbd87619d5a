"""Follow an adapter's path through the package as the data travels it: which files a read enters, in order.

Run: .venv/bin/python scripts/trace_read.py [--digest] [--when cold|checked|again]
Every call from one file of the package into another that one LoraAdapterStore.load of a small
Llama-shaped adapter makes is recorded by the callee's file, at the callee's first call (a loop calling a
helper a thousand times is one step of the path; a return is no step); consecutive steps into one file
are one stay. A climb back is a stay in a file the read had already entered: the read going back to ask
a module again for what it could have been told once.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

import mstar.engine.resources.lora as lora
from mstar.engine.resources.lora import LoraAdapterStore, check_adapter_file, specs_from_config
from mstar.engine.resources.lora.tools.samples import sample_modules, write_peft_adapter

PACKAGE = str(Path(lora.__file__).parent)


def trace(fn) -> list[str]:
    calls: list[str] = []
    seen: set = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code not in seen:
            seen.add(frame.f_code)
            file, caller = frame.f_code.co_filename, frame.f_back.f_code.co_filename if frame.f_back else ""
            if file.startswith(PACKAGE) and file != caller:
                calls.append(file[len(PACKAGE) + 1 :])

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def stays(calls: list[str]) -> list[str]:
    out: list[str] = []
    for f in calls:
        if not out or out[-1] != f:
            out.append(f)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--digest", action="store_true", help="load with the adapter's digest, as the manager reads")
    p.add_argument("--when", choices=["cold", "checked", "again"], default="again",
                   help="a header never seen; seen by the startup check only; or read before, as every read "
                        "after an eviction (the default)")
    args = p.parse_args()
    spec = specs_from_config("tiny-llama", max_rank=16)["language_model"]
    with tempfile.TemporaryDirectory() as root:
        path = write_peft_adapter(Path(root) / "ad", sample_modules(spec, 8, dtype=torch.bfloat16), alpha=16,
                                  alpha_pattern={"down_proj": 32})
        digest = check_adapter_file(spec, "ad", path) if args.digest or args.when != "cold" else None
        store = LoraAdapterStore(spec, pin=False)
        if args.when == "again":
            store.read("ad", path, digest if args.digest else None)
        path_stays = stays(trace(lambda: store.load("ad", path, digest if args.digest else None)))
    seen, climbs = set(), 0
    for f in path_stays:
        climbs += f in seen
        seen.add(f)
    print(" -> ".join(path_stays))
    print(f"{len(path_stays)} stays in {len(seen)} files, {climbs} climbs back to a file already left")


if __name__ == "__main__":
    main()
