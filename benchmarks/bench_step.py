"""Training-step time of Keras distributions against native PyTorch.

Launch with torchrun, one process per GPU (or CPU processes on gloo)::

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_step.py
    ./run_multi_gpu.sh benchmarks/bench_step.py --model mlp --rounds 20

The same training work is done four ways on the same N ranks, from the same
initial weights, on the same global batch:

* ``keras_mp``: Keras ``ModelParallel`` on a ``(1, N)`` ("batch", "model")
  mesh, Megatron layout (first Dense kernel ``(None, "model")``, its bias
  ``("model",)``, second Dense kernel ``("model", None)``; attention heads
  sharded);
* ``native_tp``: ``parallelize_module`` with ``ColwiseParallel`` /
  ``RowwiseParallel`` on the equivalent ``nn.Module``, ``torch.optim.Adam``;
* ``keras_dp``: Keras ``DataParallel``;
* ``native_ddp``: ``DistributedDataParallel``, per-rank batch = global / N.

Two more pairs give the floor, what Keras costs over torch with no
distribution at all: every rank trains, alone and without communicating,
the share of the work it has in the distributed steps:

* ``keras_local_tp`` / ``native_local_tp``: the model with H / N hidden
  units and heads / N attention heads (each of the same size) on the whole
  batch: one rank's work under tensor parallelism, minus its all-reduces;
* ``keras_local_dp`` / ``native_local_dp``: the whole model on batch / N:
  one rank's work under data parallelism, minus the gradient all-reduce.

With ``--jit-compile`` the compiled steps join them: ``keras_mp_jit`` /
``keras_dp_jit`` (``jit_compile=True``) and ``native_tp_compile`` /
``native_ddp_compile`` (``torch.compile`` of the whole step).

The Keras steps are the real Keras training step, the function ``fit`` calls
(``model.make_train_function()``, then ``model.train_function([(x, y,
None)])`` with the global batch). All implementations run interleaved: each
round runs a few steps of every one (in a rotated order), so machine drift
hits all alike. A step is timed with ``time.perf_counter()`` from right after
a barrier until it returns (after a device synchronize on GPU); the time of
a step is its slowest rank's. Warm-up steps are not timed.

Rank 0 prints the machine, a table (median / min wall time and median CPU
time of a step, collectives per step against the ideal, per-rank bytes of
parameters + optimizer state against the ideal, loss of the first step) and
the Keras / native ratios; ``--json PATH`` writes all of it, per-step times
included. ``--relayout-outputs`` adds LayoutMap ``/output`` keys that make
the row-parallel layers' outputs replicated (what ``RowwiseParallel`` does).
See benchmarks/README.md for what exactly is counted.

This file is the entry point (flags, building the runners, the main loop);
the rest lives beside it: ``bench_models`` (models, shapes, weights, data),
``keras_runners`` / ``native_runners`` (the two sides' steps),
``bench_runner`` (implementation names, ``Runner``, the timing loop),
``bench_counting`` (collectives and state bytes), ``bench_env`` (process
group, device, machine description) and ``bench_report`` (table, ratios,
JSON).
"""

import argparse
import dataclasses
import gc
import os
import sys
from pathlib import Path

# Before anything imports keras: its backend is read at import.
os.environ.setdefault("KERAS_BACKEND", "torch")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_env import machine_info  # noqa: E402
from bench_env import sdpa_context  # noqa: E402
from bench_env import setup  # noqa: E402
from bench_models import Shapes  # noqa: E402
from bench_models import check_shapes  # noqa: E402
from bench_models import impl_shapes  # noqa: E402
from bench_models import make_data  # noqa: E402
from bench_models import reference_weights  # noqa: E402
from bench_report import format_report  # noqa: E402
from bench_report import ratios  # noqa: E402
from bench_report import summarize  # noqa: E402
from bench_report import write_json  # noqa: E402
from bench_runner import COMPILED_IMPLS  # noqa: E402
from bench_runner import EAGER_IMPLS  # noqa: E402
from bench_runner import LOCAL_IMPLS  # noqa: E402
from bench_runner import MODELS  # noqa: E402
from bench_runner import UPSTREAM_IMPLS  # noqa: E402
from bench_runner import measure  # noqa: E402
from bench_runner import slowest_rank_times  # noqa: E402
from bench_runner import warm_up  # noqa: E402
from keras_runners import keras_runner  # noqa: E402
from native_runners import native_runner  # noqa: E402
from upstream_runners import check_upstream  # noqa: E402
from upstream_runners import upstream_runner  # noqa: E402

import keras  # noqa: E402

DEFAULT_UPSTREAM = (
    Path(__file__).resolve().parents[1]
    / "build"
    / "upstream"
    / f"keras-{keras.__version__}"
)


def parse_args(argv=None):
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS + ("all",), default="all")
    p.add_argument(
        "--impl",
        nargs="+",
        choices=EAGER_IMPLS + LOCAL_IMPLS + UPSTREAM_IMPLS + COMPILED_IMPLS,
        help="implementations to run (default: the 4 eager and the 4 local "
        "ones, upstream_local_dp where --upstream-keras exists and no GPU is "
        "visible, and the 4 "
        "compiled ones with --jit-compile)",
    )
    p.add_argument(
        "--upstream-keras",
        default=str(DEFAULT_UPSTREAM),
        metavar="PATH",
        help="pristine Keras tree the upstream_local_* runners import "
        "(default: build/upstream/keras-VERSION of this repository)",
    )
    p.add_argument(
        "--jit-compile", action="store_true", help="also run the compiled steps"
    )
    p.add_argument("--batch", type=int, default=128, help="global batch")
    p.add_argument("--dim", type=int, default=512, help="model width D")
    p.add_argument("--hidden", type=int, default=2048, help="MLP width H")
    p.add_argument(
        "--seq-len", type=int, default=4, help="transformer sequence length"
    )
    p.add_argument(
        "--heads", type=int, default=8, help="transformer attention heads"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=5,
        help="timed steps of each implementation per round",
    )
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed steps of each implementation first",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads per rank"
    )
    p.add_argument(
        "--sdpa",
        choices=("auto", "math"),
        default="auto",
        help="attention kernel of both sides; auto = math on CPU "
        "(DTensor has no sharding rule for the CPU flash "
        "attention backward), the default kernels on GPU",
    )
    p.add_argument(
        "--relayout-outputs",
        action="store_true",
        help="keras_mp: add LayoutMap keys 'fc2/output' (and "
        "'attn/output') that make the row-parallel outputs "
        "replicated, as native RowwiseParallel does",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results here")
    args = p.parse_args(argv)
    if args.impl is None:
        args.impl = list(EAGER_IMPLS) + list(LOCAL_IMPLS)
        # The pristine worker runs on CPU only.
        if os.path.isdir(args.upstream_keras) and not torch.cuda.is_available():
            args.impl.append("upstream_local_dp")
        if args.jit_compile:
            args.impl += list(COMPILED_IMPLS)
    if any(i.startswith("upstream_") for i in args.impl):
        check_upstream(args.upstream_keras)
    args.models = list(MODELS) if args.model == "all" else [args.model]
    return args


def build_runners(args, device):
    """All requested runners, every model and implementation."""
    ctx = sdpa_context(args, device)
    runners = []
    for kind in args.models:
        # Weights and data per shapes: the two sides of a pair share them.
        inputs = {}
        for impl in args.impl:
            shapes = impl_shapes(impl, args.shapes, dist.get_world_size())
            key = dataclasses.astuple(shapes)
            if key not in inputs:
                inputs[key] = (
                    reference_weights(kind, shapes, args.seed),
                    make_data(kind, shapes, args.seed, device),
                )
            ref, data = inputs[key]
            if impl.startswith("upstream"):
                runner = upstream_runner(
                    kind, impl, shapes, ref, data, args, device
                )
            elif impl.startswith("keras"):
                runner = keras_runner(kind, impl, shapes, ref, data, ctx, args)
            else:
                runner = native_runner(
                    kind, impl, shapes, ref, data, ctx, args, device
                )
            runners.append(runner)
    keras.distribution.set_distribution(None)
    return runners


def main(argv=None):
    args = parse_args(argv)
    args.shapes = Shapes(
        args.batch, args.dim, args.hidden, args.seq_len, args.heads
    )
    device = setup(args)
    check_shapes(args.shapes, args.models, dist.get_world_size())
    runners = build_runners(args, device)
    for runner in runners:
        warm_up(runner, max(args.warmup, 1))
    for runner in runners:
        runner.activate()
        runner.collectives = runner.count() if runner.count else None
        runner.bytes = runner.state_bytes()
    keras.distribution.set_distribution(None)
    measure(runners, args, device)
    slowest_rank_times(runners)
    results = [summarize(r) for r in runners]
    pair_ratios = ratios(results)
    if dist.get_rank() == 0:
        info = machine_info(args, device)
        sys.stdout.write(format_report(info, args, results, pair_ratios) + "\n")
        sys.stdout.flush()
        if args.json:
            write_json(args.json, info, args, results, pair_ratios)
    dist.barrier()
    for runner in runners:
        if runner.close is not None:
            runner.close()
    # Torn down here, not at interpreter exit: the DDP reducers and gloo's
    # threads still alive then can abort a rank ("terminate called without
    # an active exception").
    del runners
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
