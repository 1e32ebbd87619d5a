"""`mstar-lora check` as a deployment's gate runs it, a fresh interpreter a call, against the same call in an
interpreter that imports torch first (what every call paid before the check path stopped importing it).

Run: .venv/bin/python benchmarks/bench_check_command.py [--repeat 9]
The adapter is the Llama-3-8B-shaped r=16 bf16 one (about 84 MB) and a 1 MB one, checked against the
llama-3.1-8b preset at max_rank 16; the two commands run interleaved, each timed from spawn to exit.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_adapters

CHECK = "import sys\nfrom mstar.engine.resources.lora.tools.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        large, small = write_adapters(Path(tmp))
        command = ["check", "llama-3.1-8b", str(large), str(small), "--max-rank", "16", "--json"]
        sides = {"check": CHECK, "check after import torch": "import torch\n" + CHECK}
        times: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(args.repeat):
            for name, code in sides.items():
                t = time.perf_counter()
                subprocess.run([sys.executable, "-c", code, *command], check=True, capture_output=True)
                times[name].append(time.perf_counter() - t)
    median = {k: statistics.median(v) for k, v in times.items()}
    for k, v in median.items():
        print(f"{k:26s} {v * 1000:8.0f} ms (median of {args.repeat})")
    print(f"ratio: {median['check after import torch'] / median['check']:.2f}x")


if __name__ == "__main__":
    main()
