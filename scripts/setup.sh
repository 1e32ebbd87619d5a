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
# transformers 4.57.1 beside 5, for tests/test_experts_transformers4.py: gpt-oss's experts there carry no
# is_transposed, so PEFT puts lora_A on their output side. Only it and the two packages it wants older
# than the venv's (huggingface_hub < 1, tokenizers <= 0.23.0), pinned and without their dependencies,
# which the venv has: a folder a test puts first on a subprocess's PYTHONPATH, never on the venv's path.
TF4=.venv/transformers-4.57.1
if [ ! -f "$TF4/.installed" ]; then  # written once the install is whole
  rm -rf "$TF4"
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --target "$TF4" \
    transformers==4.57.1 huggingface_hub==0.36.2 tokenizers==0.22.2
  touch "$TF4/.installed"
fi
