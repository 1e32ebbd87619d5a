#!/usr/bin/env bash
# The checks that need a GPU, in one run (a lent H200 takes a few minutes): the CUDA tests (pinned host memory
# registered and released, asynchronous activation, the side stream's order, the Triton kernels against PEFT in
# bf16, in a CUDA graph and with no host synchronisation; test_kernels.py compiled rather than interpreted), then
# benchmarks/bench_kernels.py; then one table of both. Logs and JSON land in $OUT (default /tmp/gpu-check).
#
# It uses .venv where that has a CUDA torch, else the machine's python3 with this package from src/. A GPU machine
# with no registry to reach lacks blake3: fetch its wheel here first (bash scripts/gpu-check.sh --fetch-wheels puts
# it in .whl/, which git ignores) and carry .whl along; it is installed into /tmp/site there.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--fetch-wheels" ]; then
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl blake3
fi

OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=.venv/bin/python
if ! { [ -x "$PY" ] && "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; }; then
  PY=python3
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  if ! "$PY" -c "import blake3" 2>/dev/null && ls .whl/blake3-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
fi
"$PY" -c "import torch, triton, mstar.engine.resources.lora as m; print('torch', torch.__version__, 'triton', \
triton.__version__, torch.cuda.get_device_name())" || exit 1

"$PY" -m pytest -p no:warnings -q -rfE tests/test_cuda.py tests/test_kernels.py --junitxml "$OUT/tests.xml" \
  2>&1 | tee "$OUT/tests.log"
"$PY" benchmarks/bench_kernels.py --json "$OUT/bench.json" 2>"$OUT/bench.err" | tee "$OUT/bench.log"

"$PY" - "$OUT/tests.xml" "$OUT/bench.json" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
rows = []
try:
    for case in ET.parse(sys.argv[1]).iter("testcase"):
        verdict = "failed" if case.find("failure") is not None or case.find("error") is not None else \
            "skipped" if case.find("skipped") is not None else "passed"
        rows.append((f"{case.get('classname').split('.')[-1]}::{case.get('name')}", verdict, ""))
except (OSError, ET.ParseError) as e:
    rows.append(("tests", f"no results ({e})", ""))
try:
    bench = json.load(open(sys.argv[2]))
    rows += [tuple(c) for c in bench["checks"]]
    for r in bench["rows"]:
        if r["tokens"] in (1, 64, 256, 2048, 8192) and r["adapters"] in (1, 64) or r["max_rank"] == 8:
            share = lambda k: f"{100 * r[k] / r['base_us']:.1f}%" if k in r else "n/a"
            rows.append((f"LoRA/base {r['shape']} {r['tokens']} tok, {r['adapters']} adapters, r {r['rank']}/{r['max_rank']}",
                         f"triton {share('triton_us')}, gather+bmm {share('gather_bmm_us')}, reference {share('reference_us')}",
                         f"base {r['base_us']:.0f} µs"))
except (OSError, KeyError, ValueError) as e:
    rows.append(("bench_kernels", f"no results ({e})", ""))
print("\n| check | measured | target / note |\n|---|---|---|")
for r in rows:
    print("| " + " | ".join(r) + " |")
EOF
