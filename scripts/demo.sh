#!/usr/bin/env bash
# Sets up .venv if needed, then runs the demo on the built-in tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/mstar-lora demo "$@"
