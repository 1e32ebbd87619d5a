#!/usr/bin/env bash
# Makes .venv with this package and its test tools. A torch already installed (a CUDA build,
# say) is kept: the venv sees the system's packages. Where there is none, torch==2.13.0 is
# installed, which on these machines is a CPU build on local disk (plain `torch` would pull
# a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
if ! .venv/bin/python -c "import mstar.engine.resources.lora, peft, transformers, diffusers, hypothesis, blake3" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.installed ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
  touch .venv/.installed
fi
