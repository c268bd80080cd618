#!/usr/bin/env bash
# Fetch, on a machine with package-index access, the wheels gpu_check.sh installs offline on the GPU machine:
#   bash scripts/gpu_wheels.sh [DIR]      (default wheels/, ignored by git; carry it with the checkout)
# The peers (OLMo-core 3.0.0, torchtitan 0.3.0), torchao for the FP8 run, and the pure-Python modules
# they import that the GPU image (torch 2.11 + CUDA, Python 3.12) lacks. Never torch, triton, nvidia-*
# or CUDA packages: those stay the image's own. Each wheel is fetched with --no-deps, so the list
# below is the whole closure; tests/test_gpu_wheels.py checks it. Fails if the total passes 60 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-wheels}"
py="${PYTHON:-.venv/bin/python}"
[ -x "$py" ] || py=python3
# name==version for the peers and torchao (what is measured); the rest at the version pip picks today.
PINNED=(
  ai2-olmo-core==3.0.0 torchtitan==0.3.0 torchao==0.18.0
  # olmo_core imports at load: its own requirements the image lacks
  cached-path dataclass-extensions bettermap dill importlib-resources
  # cached_path's scheme clients, imported when cached_path loads
  boto3 botocore s3transfer jmespath google-cloud-storage google-cloud-core google-api-core google-auth
  google-resumable-media google-crc32c googleapis-common-protos proto-plus pyasn1 pyasn1-modules rsa cachetools
  cryptography cffi pycparser
  # torchtitan's model and config modules
  spmd-types==0.2.3 tyro docstring-parser typeguard shtab torchdata torch-checkpointing
)
MAX_BYTES=60000000
mkdir -p "$dir"
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dir" "${PINNED[@]}"
total=0
for w in "$dir"/*.whl; do
  size=$(stat -c %s "$w")
  total=$((total + size))
  printf 'gpu_wheels: %8d KB %s\n' $((size / 1000)) "$(basename "$w")"
done
echo "gpu_wheels: $(ls "$dir"/*.whl | wc -l) wheels, $((total / 1000000)) MB in $dir (limit $((MAX_BYTES / 1000000)) MB)"
if [ "$total" -gt "$MAX_BYTES" ]; then
  echo "gpu_wheels: over the limit: drop a wheel or raise it knowingly" >&2
  exit 1
fi
