#!/usr/bin/env bash
# ~1B Llama bf16 training MFU on one H200: jaxlearn vs PyTorch + HF, same config.
# Prepared, not run here: the device time is someone else's call. About 3-4 minutes:
# two pip installs (cached in $GPU_BENCH_CACHE), ~1 min per framework (compile + 13 steps).
#
#   bash tools/bench/gpu_h200.sh            # from the repository root, on the GPU machine
#   GPU_BENCH_STEPS=20 bash tools/bench/gpu_h200.sh
#
# Output: JSON lines (BENCH_RESULT ...) on stdout and in $OUT/gpu_h200.jsonl (or
# tools/bench/results/gpu_h200.jsonl when $OUT is unset). The two frameworks run in
# separate venvs and processes, alternating jax, torch, jax, torch when GPU_BENCH_REPEATS=2.
# Needs pip access to PyPI (or a mirror) from the GPU machine; set GPU_JAX_VENV /
# GPU_TORCH_VENV to use venvs that already have the packages.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
CACHE="${GPU_BENCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/jaxlearn}"
STEPS="${GPU_BENCH_STEPS:-10}"
REPEATS="${GPU_BENCH_REPEATS:-1}"
RESULT="${OUT:-$HERE/results}/gpu_h200.jsonl"
mkdir -p "$(dirname "$RESULT")" "$CACHE"
PY="${PYTHON:-python3}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

JV="${GPU_JAX_VENV:-$CACHE/gpu-jax-venv}"
TV="${GPU_TORCH_VENV:-$CACHE/gpu-torch-venv}"
if [ ! -f "$JV/.ok" ]; then
  "$PY" -m venv "$JV"
  # The project's pins (jax 0.10.2, optax, orbax, ...) with the CUDA 12 plugin.
  grep -v '^jax\[cpu\]' "$ROOT/third_party/python/requirements.txt" > "$CACHE/gpu-reqs.txt"
  "$JV/bin/pip" install --quiet "jax[cuda12]==0.10.2" -r "$CACHE/gpu-reqs.txt"
  touch "$JV/.ok"
fi
if [ ! -f "$TV/.ok" ]; then
  "$PY" -m venv "$TV"
  # The default Linux torch wheel on PyPI is the CUDA build.
  "$TV/bin/pip" install --quiet torch==2.13.0 transformers==5.24.0 safetensors numpy
  touch "$TV/.ok"
fi

export PYTHONPATH="$(printf '%s:' "$ROOT"/packages/*/src)$HERE"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
run() {  # run VENV FRAMEWORK
  timeout 300 "$1/bin/python" "$HERE/gpu_h200.py" --framework "$2" --steps "$STEPS" \
    | tee -a /dev/stderr | grep '^BENCH_RESULT ' | sed 's/^BENCH_RESULT //' >> "$RESULT" \
    || echo "{\"bench\": \"gpu_train\", \"framework\": \"$2\", \"ok\": false}" >> "$RESULT"
}
for i in $(seq "$REPEATS"); do
  if [ $((i % 2)) -eq 1 ]; then run "$JV" jax; run "$TV" torch; else run "$TV" torch; run "$JV" jax; fi
done
echo "results: $RESULT"
cat "$RESULT"
