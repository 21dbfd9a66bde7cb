#!/usr/bin/env bash
# The checks that need a GPU: the CUDA tests, then the step benchmarks on
# one process per GPU (NCCL). Needs this package installed in `python3`
# (or $PY), with pytest and pytest-timeout.
#
# Usage: scripts/gpu_check.sh [OUT_DIR]
#   OUT_DIR gets the GPUs seen, the tests' logs and each benchmark's output.
set -uo pipefail

PY="${PY:-python3}"
OUT="${1:-build/gpu-check}"
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export KERAS_BACKEND=torch PYTHONUNBUFFERED=1

nvidia-smi -L | tee "$OUT/gpus.txt"
"$PY" -c 'import torch, keras; print("torch", torch.__version__, "cuda",
torch.version.cuda, "nccl", torch.cuda.nccl.version(), "keras",
keras.__version__)' | tee -a "$OUT/gpus.txt"
gpus="$(nvidia-smi -L | grep -c '^GPU ')"

status=0
# The catalogue (the longest) last, each part bounded: what ran is in its log.
tests() {
  local name="$1" select="$2" limit="$3"
  timeout "$limit" "$PY" -m pytest -p no:cacheprovider -v --tb=short \
    --durations=0 tests/test_cuda.py -k "$select" 2>&1 |
    tee "$OUT/$name.log" || status=1
}
tests test_cuda_training "not catalogue" "${GPU_CHECK_TRAINING_TIMEOUT:-300}"
tests test_cuda_catalogue "catalogue" "${GPU_CHECK_CATALOGUE_TIMEOUT:-400}"

bench() {
  local name="$1"
  shift
  timeout "${GPU_CHECK_BENCH_TIMEOUT:-150}" "$PY" -m torch.distributed.run \
    --standalone --nproc-per-node="$gpus" "$@" 2>&1 |
    tee "$OUT/$name.log" || status=1
}
# Widths where a step is GPU work, not Python dispatch.
bench bench_step benchmarks/bench_step.py --dim 2048 --hidden 8192 \
  --batch 256 --seq-len 128 --heads 16 --rounds "${GPU_CHECK_ROUNDS:-10}" \
  --json "$OUT/bench_step.json"
bench bench_data_parallel benchmarks/bench_data_parallel.py --batch 256 \
  --rounds "${GPU_CHECK_ROUNDS:-10}"
exit "$status"
