"""Runners of pristine Keras (`upstream_local_*`): the single-process pair.

Pristine Keras 3.15.1 and this package's Keras cannot be imported in one
process, so each rank starts a worker process (`upstream_worker.py`) with
the pristine tree first on `PYTHONPATH` and drives its training step over a
pipe. The worker times its own steps: the pipe's round trip is not counted.
With no distribution, `keras_local_dp / upstream_local_dp` is what this
package costs a single-process user (1.0 = nothing).
"""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist
from bench_runner import Runner

WORKER = Path(__file__).resolve().parent / "upstream_worker.py"


def upstream_runner(kind, impl, shapes, ref, data, args, device):
    """A runner of pristine Keras' train step in a worker process."""
    if device.type != "cpu":
        raise ValueError(
            f"{impl} runs on CPU only; received device {device}. Leave it "
            "out with --impl."
        )
    root = Path(args.upstream_keras).resolve()
    worker = _start_worker(root)
    x, y = (t.numpy() for t in data)
    math_sdpa = True  # As `sdpa_context` on CPU.
    keras_file = Path(
        _call(
            worker, ("init", kind, shapes, ref, x, y, args.threads, math_sdpa)
        )
    ).resolve()
    if not keras_file.is_relative_to(root):
        raise RuntimeError(
            f"The worker imported Keras from {keras_file}, not from the "
            f"pristine tree {root}."
        )
    runner = Runner(
        kind,
        impl,
        step=lambda: _call(worker, ("step",)),
        activate=lambda: None,
        count=None,
        state_bytes=lambda: 0,
        ideal_collectives=0,
        ideal_bytes=0,
        loss_fn=lambda answer: answer[2],
        notes=[f"pristine Keras from {keras_file}"],
        self_timed=True,
    )
    runner.close = lambda: _stop_worker(worker)
    return runner


def check_upstream(path):
    """Raises ValueError unless `path` holds a pristine Keras tree."""
    if not (Path(path) / "keras" / "__init__.py").is_file():
        raise ValueError(
            f"--upstream-keras {path}: no keras/__init__.py there. Build "
            "the pristine tree with `./run_tests.sh "
            "tests/test_single_process_path.py`, or leave upstream_local_* "
            "out with --impl."
        )


def _start_worker(root):
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=str(root))
    # Not a member of the torchrun job.
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.Popen(
        [sys.executable, str(WORKER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        cwd=WORKER.parent,
    )


def _call(worker, request):
    pickle.dump(request, worker.stdin)
    worker.stdin.flush()
    try:
        return pickle.load(worker.stdout)
    except EOFError:
        raise RuntimeError(
            f"The pristine Keras worker of rank {dist.get_rank()} exited "
            f"(code {worker.wait()}); its error is above."
        ) from None


def _stop_worker(worker):
    if worker.poll() is None:
        pickle.dump(("exit",), worker.stdin)
        worker.stdin.close()
        worker.wait(timeout=60)
