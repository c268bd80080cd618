#!/usr/bin/env bash
# Create .venv/ and install moeforge with its test, bench and tracking extras from the lock:
# requirements.lock pins every dependency with sha256 hashes (refresh it with `make lock`).
# torch is not in the lock: on CPU machines torch==2.13.0 (CPU build) is installed first so
# nothing pulls a CUDA build; on a GPU machine, install the CUDA torch you want into .venv
# first and this script keeps it. Idempotent: re-installs only when a lock file changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install -q torch==2.13.0
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
