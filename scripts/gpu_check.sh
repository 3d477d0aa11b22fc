#!/usr/bin/env bash
# Everything that needs the GPU, in one call on the device machine: the GPU tests, then the
# benchmarks of SPEC section 6. Logs go to $OUT (or ./gpu-out); a short table is printed last.
#   bash scripts/gpu_check.sh [quick|full] [pytest -k expression]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
MODE=${1:-quick}; KEXPR=${2:-}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
RESULTS=$OUT/results.md; : > "$RESULTS"
summary=()
run() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  summary+=("$(printf '%-16s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-90)")")
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' >> "$OUT/gpu.txt" 2>&1
run pytest-gpu python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/moe tests/models ${KEXPR:+-k "$KEXPR"}
run bench-copy python3 -m benchmarks.bench_copy --out "$RESULTS"
run bench-admission python3 -m benchmarks.bench_admission --out "$RESULTS"
run bench-fused-moe python3 -m benchmarks.bench_fused_moe --out "$RESULTS"
[ -f benchmarks/bench_attention.py ] && run bench-attention python3 -m benchmarks.bench_attention --out "$RESULTS"
if [ "$MODE" = quick ]; then
  run bench-decode python3 -m benchmarks.bench_decode --layers 4 --batch 1 4 --steps 8 --out "$RESULTS"
else
  run bench-decode python3 -m benchmarks.bench_decode --out "$RESULTS"
fi
echo; cat "$OUT/gpu.txt"; echo
printf '%s\n' "${summary[@]}"
