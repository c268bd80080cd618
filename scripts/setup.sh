#!/usr/bin/env bash
# Create .venv/ and install moeforge with its test, bench, tracking, lowp and docs extras from the lock:
# requirements.lock pins every dependency with sha256 hashes (refresh it with `make lock`).
# torch is not in the lock (its dependencies are). An installed torch is kept: on a GPU machine,
# install the CUDA build you want into .venv first. Otherwise torch==2.13.0 is installed first,
# so nothing later pulls a CUDA build:
#   1. from the wheels pip finds without an index (a local wheel directory configured as pip
#      find-links, as on the development and CI machines, which hold the CPU build);
#   2. else from PyTorch's CPU wheel index (a stock machine: PyPI's Linux wheel is the CUDA build).
# Idempotent: re-installs only when a lock file changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if ! .venv/bin/pip install -q --no-deps --no-index torch==2.13.0 2>/dev/null; then
    .venv/bin/pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
  fi
fi
stamp=.venv/.moeforge-lock
want=$(cat requirements.lock requirements-nodeps.lock pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c "import moeforge" >/dev/null 2>&1; then
  .venv/bin/pip install -q --require-hashes -r requirements.lock
  .venv/bin/pip install -q --require-hashes --no-deps -r requirements-nodeps.lock
  .venv/bin/pip install -q --no-deps -e .
  .venv/bin/python scripts/check_lock.py requirements.lock requirements-nodeps.lock
  echo "$want" > "$stamp"
fi
