#!/usr/bin/env bash
# Runs a script under torchrun with Keras on PyTorch: one process per visible
# GPU, or 2 CPU processes on gloo when there is none. See usage below.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: ./run_multi_gpu.sh [options] SCRIPT [SCRIPT ARGS...]

Runs SCRIPT with torchrun (python -m torch.distributed.run from .venv) and
KERAS_BACKEND=torch: one process per visible GPU, or 2 CPU processes (gloo)
when no GPU is found. Single node by default (torchrun --standalone, which
picks a free port). Sets up .venv first if needed (see scripts/bootstrap.sh).

Options:
  -n, --nproc-per-node N   processes on this node (default: GPU count, or 2)
  --dry-run                print the torchrun command instead of running it
                           (also RUN_MULTI_GPU_DRY_RUN=1); sets up nothing
  -h, --help               this help

Multi-node flags, passed to torchrun (they turn --standalone off):
  --nnodes, --node-rank, --rdzv-endpoint, --rdzv-backend, --rdzv-id,
  --rdzv-conf, --master-addr, --master-port
Also passed to torchrun:
  --max-restarts, --monitor-interval, --log-dir, --redirects, --tee,
  --local-addr, --start-method
Each as "--flag VALUE" or "--flag=VALUE" (underscores work too).

Example, two nodes (run on each, with its own --node-rank):
  ./run_multi_gpu.sh --nnodes 2 --node-rank 0 --rdzv-backend c10d \
      --rdzv-endpoint node0:29500 --rdzv-id job1 train.py
EOF
}

die() { echo "run_multi_gpu.sh: $*" >&2; exit 2; }

source "$(dirname "${BASH_SOURCE[0]}")/scripts/bootstrap.sh"

# Counts the GPUs this run may use, honouring CUDA_VISIBLE_DEVICES.
gpu_count() {
  local visible="${CUDA_VISIBLE_DEVICES-unset}" count=0
  if [[ -z "$visible" || "$visible" == -1* ]]; then
    echo 0
    return
  fi
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    count="$(nvidia-smi -L | grep -c '^GPU ' || true)"
    if [[ "$visible" != unset ]]; then
      local ids
      IFS=, read -ra ids <<<"$visible"
      if ((${#ids[@]} < count)); then count=${#ids[@]}; fi
    fi
  elif [[ -x "$PY" ]]; then
    count="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
  fi
  echo "$count"
}

nproc=""
standalone=1
dry_run="${RUN_MULTI_GPU_DRY_RUN:-}"
torchrun_args=()
while (($#)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --dry-run) dry_run=1; shift ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;;  # --flag=value -> --flag value
    -n | --nproc-per-node | --nproc_per_node)
      (($# >= 2)) || die "$1 needs a value"
      [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1 needs a positive integer, got '$2'"
      nproc="$2"; shift 2 ;;
    --nnodes | --node-rank | --node_rank | --rdzv-endpoint | --rdzv_endpoint | \
      --rdzv-backend | --rdzv_backend | --rdzv-id | --rdzv_id | --rdzv-conf | \
      --rdzv_conf | --master-addr | --master_addr | --master-port | --master_port | \
      --max-restarts | --max_restarts | --monitor-interval | --monitor_interval | \
      --log-dir | --log_dir | --redirects | --tee | --local-addr | --local_addr | \
      --start-method | --start_method)
      (($# >= 2)) || die "$1 needs a value"
      case "$1" in
        --nnodes | --node* | --rdzv* | --master*) standalone="" ;;
      esac
      torchrun_args+=("$1" "$2"); shift 2 ;;
    --) shift; break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) break ;;
  esac
done
(($#)) || { usage >&2; exit 2; }

[[ -n "$dry_run" ]] || bootstrap_venv

gpus="$(gpu_count)"
if ((gpus > 0)); then
  nproc="${nproc:-$gpus}"
else
  nproc="${nproc:-2}"
  echo "run_multi_gpu.sh: no GPU found: running $nproc CPU processes on gloo" >&2
fi
if [[ -n "$standalone" ]]; then
  torchrun_args=(--standalone "${torchrun_args[@]}")
fi

export KERAS_BACKEND=torch
env_vars=(KERAS_BACKEND=torch)
# torchrun's own default for several processes, which it otherwise sets
# with a warning banner: one OpenMP thread each unless told otherwise.
if ((nproc > 1)) && [[ -z "${OMP_NUM_THREADS+set}" ]]; then
  export OMP_NUM_THREADS=1
  env_vars+=(OMP_NUM_THREADS=1)
fi
cmd=("$PY" -m torch.distributed.run "${torchrun_args[@]}" --nproc-per-node "$nproc" "$@")
if [[ -n "$dry_run" ]]; then
  printf '%s' "${env_vars[*]}"
  printf ' %q' "${cmd[@]}"
  echo
  exit 0
fi
exec "${cmd[@]}"
