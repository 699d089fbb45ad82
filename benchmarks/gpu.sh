#!/usr/bin/env bash
# jamp on one GPU: the GPU-branch tests, then three benchmark runs (~10 minutes in all).
#
#     bash benchmarks/gpu.sh [OUT_DIR]      # from any directory
#     PYTHON=/path/to/python bash benchmarks/gpu.sh
#
# Needs jax with CUDA (pip install -e '.[cuda12,test]'), optax, flax, jmp.
# Everything it prints is also written to OUT_DIR/gpu.sh.log (default OUT_DIR:
# benchmarks/gpu_results), next to where.txt (what ran where), each run's report
# and log. It stops when JAX's default backend is not a GPU, unless
# GPU_SH_ALLOW_CPU=1; GPU_SH_SMOKE=1 runs both benchmarks with --tiny (and
# allows the CPU) to check this script itself in seconds.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:-${OUT:-$ROOT/benchmarks/gpu_results}}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # an OUT_DIR relative to the caller's directory stays there
PY=${PYTHON:-python}
SMOKE=${GPU_SH_SMOKE:-0}
cd "$ROOT"  # `python -m benchmarks <experiment>` and the tests run from the repository root
export XLA_PYTHON_CLIENT_PREALLOCATE=false

# ---------------------------------------------------------------- GPU-branch tests
# The tests of the code paths a GPU compiles differently (the finite check's
# default branch through the platform switch, golden trajectories, the skip
# machinery, autocast, the report), run on the GPU itself; tests that need the
# 8 virtual CPU devices are deselected (-m "not multidevice").
GPU_TESTS=(
  tests/finite/test_finite.py tests/finite/test_finite_default.py tests/test_loss_scale.py
  tests/test_loss_scaling.py tests/grad_scaler/test_grad_scaler.py tests/test_value_and_grad.py
  tests/finite/test_report.py tests/autocast/test_autocast.py tests/integration/test_golden_scenarios.py
)
# ----------------------------------------------------------------------------------

if [[ $SMOKE == 1 ]]; then
  MODE=(--tiny) FINITE_SIZES=()
  FLOAT8=(--tiny --step-rounds 1 --step-reps 1)
  AUTOCAST=(--tiny --step-rounds 1 --step-reps 1)
else
  MODE=(--quick) FINITE_SIZES=(--finite-sizes 1e6,1e7,5e7)
  FLOAT8=(--step-config large)
  AUTOCAST=(--step-config large)
fi

where() {
  echo "== gpu.sh, $(date -Is), host $(hostname)"
  echo "== repository $ROOT at $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(
    git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader |
      sed 's/^/== nvidia-smi: GPU /'
  else
    echo "== nvidia-smi: not found"
  fi
  "$PY" - <<'EOF'
import platform, sys

import jax, jaxlib

devices = jax.devices()
print(f"== python {platform.python_version()} ({sys.executable})")
print(f"== jax {jax.__version__}, jaxlib {jaxlib.__version__}; default backend "
      f"{jax.default_backend()}; {len(devices)} device(s):")
for d in devices:
    print(f"==   {d.platform}:{d.id} {d.device_kind}")
EOF
}

main() {
  where | tee "$OUT/where.txt"
  local backend
  backend=$("$PY" -c 'import jax; print(jax.default_backend())')
  if [[ $backend != gpu && $SMOKE != 1 && ${GPU_SH_ALLOW_CPU:-0} != 1 ]]; then
    echo "== JAX's default backend is '$backend', not gpu: stopping (GPU_SH_ALLOW_CPU=1 runs anyway)"
    return 1
  fi
  declare -A status

  # 0. The GPU-branch tests.
  if ((${#GPU_TESTS[@]})); then
    echo "== 0. pytest ${GPU_TESTS[*]} on $backend"
    # tests/conftest.py defaults JAX_PLATFORMS to cpu: name the GPU platform.
    # One process on the one GPU (pyproject's addopts asks for two workers, and the
    # device image may not have pytest-xdist): addopts overridden.
    if JAX_PLATFORMS=${GPU_SH_TEST_PLATFORM:-cuda} timeout 360 "$PY" -m pytest -q -x \
      -o addopts=-ra -p no:cacheprovider -m "not multidevice" "${GPU_TESTS[@]}" 2>&1 |
      tee "$OUT/pytest_gpu.txt"; then
      status[tests]=passed
    else
      status[tests]="FAILED (rc $?)"
    fi
  else
    status[tests]="none listed (GPU_TESTS at the top of benchmarks/gpu.sh)"
  fi

  # 1. Same benchmark as on CPU (float32 steps, every peer on both models,
  #    finite checks up to 50M elements); ~3 min.
  echo "== 1. float32 benchmark on $backend: ${MODE[*]}"
  if timeout 300 "$PY" -m benchmarks loss-scaling "${MODE[@]}" "${FINITE_SIZES[@]}" --no-torch \
    --out "$OUT/RESULTS_gpu_f32.md" 2>&1 | tee "$OUT/log_f32.txt"; then
    status[f32]="ok: $OUT/RESULTS_gpu_f32.md"
  else
    status[f32]="FAILED or timed out (rc $?): see $OUT/log_f32.txt"
  fi

  # 2. Float8 (issue #18): GPT step time of bfloat16 vs jamp.autocast(f, "float8")
  #    (current, delayed, attention in bfloat16) on d=1024, 8 layers, batch 16x512, and
  #    the cuBLASLt float8 GEMMs (__cublas$lt$matmul$f8) in each compiled step; ~3 min.
  echo "== 2. float8 step time and float8 GEMMs on $backend: ${FLOAT8[*]}"
  if timeout 300 "$PY" -m benchmarks float8 --step-time "${FLOAT8[@]}" \
    --out "$OUT/RESULTS_gpu_float8.md" 2>&1 | tee "$OUT/log_float8.txt"; then
    status[float8]="ok: $OUT/RESULTS_gpu_float8.md"
  else
    status[float8]="FAILED or timed out (rc $?): see $OUT/log_float8.txt"
  fi

  # 3. Autocast (issue #17): GPT step time and temp memory of float32 vs
  #    jamp.autocast bfloat16/float16 vs Flax modules with dtype=; ~2 min.
  echo "== 3. autocast step time on $backend: ${AUTOCAST[*]}"
  if timeout 240 "$PY" -m benchmarks autocast-memory --step-time "${AUTOCAST[@]}" \
    --out "$OUT/RESULTS_gpu_autocast.md" 2>&1 | tee "$OUT/log_autocast.txt"; then
    status[autocast]="ok: $OUT/RESULTS_gpu_autocast.md"
  else
    status[autocast]="FAILED or timed out (rc $?): see $OUT/log_autocast.txt"
  fi

  echo "== summary (what ran where: $OUT/where.txt)"
  echo "==   0. GPU-branch tests: ${status[tests]}"
  echo "==   1. float32 benchmark: ${status[f32]}"
  echo "==   2. float8 step time: ${status[float8]}"
  echo "==   3. autocast step time: ${status[autocast]}"
  [[ ${status[tests]} != FAILED* && ${status[f32]} == ok* && ${status[float8]} == ok* &&
    ${status[autocast]} == ok* ]]
}

main 2>&1 | tee "$OUT/gpu.sh.log"
