#!/usr/bin/env bash
# The jamp benchmark on one GPU, in under 8 minutes. Not run yet (no GPU was
# lent when the benchmarks were written, nor when jamp's rebuilt check was
# measured); run from the repository root:
#     bash benchmarks/gpu.sh [OUT_DIR]
# Needs jax with CUDA (pip install -e '.[cuda12]'), optax, flax, jmp.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-benchmarks/gpu_results}}
mkdir -p "$OUT"
PY=${PYTHON:-python}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
# 1. Same benchmark as on CPU (float32 steps, every peer on both models, finite
#    checks up to 50M elements); ~3 min.
timeout 300 $PY -m benchmarks --quick --all-peers --finite-sizes 1e6,1e7,5e7 --no-torch --out "$OUT/RESULTS_gpu_f32.md" 2> "$OUT/log_f32.txt" || echo "f32 run failed or timed out"
# 2. Half-precision GPT step speed-up over float32, one process, interleaved:
#    plain f32 vs plain and jamp.GradScaler.step with float16/bfloat16 matmuls; ~2 min.
timeout 200 $PY -m benchmarks --quick --models GPT --no-finite --no-torch \
  --variants jamp --half-speedup --out "$OUT/RESULTS_gpu_half.md" 2> "$OUT/log_half.txt" \
  || echo "half-precision run failed or timed out"
grep -h "^| " "$OUT/RESULTS_gpu_half.md" | head -40 || true
