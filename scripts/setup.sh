#!/usr/bin/env bash
# Makes .venv with this package and its test tools. A torch already installed (a CUDA build,
# say) is kept: the venv sees the system's packages. Where there is none, torch==2.13.0 is
# installed, which on these machines is a CPU build on local disk (plain `torch` would pull
# a multi-GB CUDA build).
#
# Once set up, .venv/.installed holds a checksum of pyproject.toml and of this script; while it
# matches, nothing is imported or installed (checking by import took 12 s a run). Edit either, or
# delete the stamp, to set up again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.installed
want=$(cat pyproject.toml scripts/setup.sh | cksum)
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
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
echo "$want" > "$STAMP"
