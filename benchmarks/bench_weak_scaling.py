"""Weak scaling of data parallelism: rows per process fixed, 1, 2, 4 processes.

    python benchmarks/bench_weak_scaling.py                 # every model
    python benchmarks/bench_weak_scaling.py --models dense own_layer \\
        --procs 1 2 --rows 32 --steps 12
    python benchmarks/bench_weak_scaling.py --models mlp --procs 1 2 \\
        --steps 200 --repeats 3 --interleaved

For each model and number of processes, two torchrun jobs train the same
Keras model on the same global batch (`--rows` rows per process):

* ``keras_dp``: Keras `DataParallel`, `train_on_batch` on the global batch;
* ``keras_ddp``: the same Keras model, without a distribution, wrapped in
  `torch.nn.parallel.DistributedDataParallel` and trained on each
  process' rows with Keras' loss and optimizer (what a user of Keras on
  DDP writes; Keras master's torch trainer does the same).

With ``--floor``, two more jobs per point, each process alone on its own
rows with no communication and no distribution: ``keras_alone`` (Keras'
`train_on_batch`) and ``loop_alone`` (``keras_ddp``'s loop without DDP).
Their difference is what Keras' own `train_on_batch` costs over that
loop; added to ``keras_ddp``'s step it is the step of a `DataParallel`
whose distribution would cost exactly DDP's communication: the floor of
the `keras_dp / keras_ddp` ratio, printed as `floor`.

With ``--interleaved``, one job per point runs these four sides and a
fifth in the same processes, in turns of `BLOCK` steps (each side under
its own distribution, the first step after a switch untimed): the
machine's state, which moves separate jobs' medians apart on a shared
machine, then changes alike for all. It measures step times only. The
fifth, ``keras_step_ddp``, is Keras' own `train_on_batch` on each
process' rows with the model's calls going through DDP, which wraps it:
what Keras master's torch trainer runs (its train step calls its
DDP-wrapped model), measured rather than estimated as the floor is.

Each job measures, per process, the peak resident memory added by its
steps (VmHWM, reset after the first steps) and the median step time, and
prints a JSON line; this driver prints, per model, a table over the
numbers of processes with `keras_dp / keras_ddp` ratios. A step's time is
the slowest process'. Each job also says which path the model took
(`local`: on each process' rows; `dtensor` and why).

Models, on (rows, 32, 256) sequences: ``dense`` (Dense(256) x 4),
``dense_dropout`` (each followed by Dropout(0.1)), ``lstm_dropout``
(LSTM(64) x 2 with dropout between), ``conv_dropout`` (Conv1D(128, 3) x 4
with SpatialDropout1D), ``own_layer`` (a user's Dense-like layer x 3),
``activity_reg`` (Dense(256) x 4, the second with an L2 activity
regularizer: that layer alone through DTensor, the rest on the local
rows) and ``activity_reg_whole`` (the same model with its probe made to
find the whole model coupling samples: all of it through DTensor, the
path of a model that couples samples outside its layers; the
DataParallel side only changes);
``mlp``, ``mlp_dropout``, ``mlp_own``, ``mlp_reg`` and ``attention``: the
data-parallel step of a multilayer perceptron on (rows, 256) features (256
-> 512 -> 512 -> 10; with Dropout(0.1) after each hidden layer; of a
user's Dense-like layer; with L2 kernel regularizers on the hidden layers)
and of an attention block (MultiHeadAttention(4 heads
of 64), LayerNormalization, Dense(512) -> Dense(256), residual) on (rows,
32, 256) sequences;
``llama`` and ``llama_dropout``: a keras-hub `LlamaCausalLM` (2 layers,
hidden 256, 8 query and 4 key/value heads, 128 tokens a row; its
backbone's `dropout` 0 or 0.1; keras-hub must be installed).
``llama_mp`` and ``llama_dropout_mp``: the Llama under `ModelParallel` on a
(N/2, 2) ("batch", "model") mesh laid out by the backbone's own
`get_layout_map` (2 or more processes, an even number), against the same
model on DDP; the dropout masks are drawn by position on the sharded
activations.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import weak_scaling_models
from weak_scaling_models import FEATURES
from weak_scaling_models import MODELS
from weak_scaling_models import SEQUENCE

IMPLS = ("keras_dp", "keras_ddp")
FLOOR_IMPLS = ("keras_alone", "loop_alone")
# With `--interleaved`: Keras' own `train_on_batch` on each process' rows,
# its model called through DDP (Keras master's torch trainer's mechanism).
STEP_DDP_IMPL = "keras_step_ddp"
# Steps a side runs in turn with `--interleaved`.
BLOCK = 10
MIB = 1024 * 1024


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--procs", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--rows", type=int, default=32, help="rows per process")
    p.add_argument("--steps", type=int, default=12, help="timed steps")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="jobs per side, alternated; the median of their medians",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also each process alone: Keras' train_on_batch and the loop",
    )
    p.add_argument(
        "--phases",
        action="store_true",
        help="with --floor: time the train step's parts (DP, Keras alone)",
    )
    p.add_argument(
        "--interleaved",
        action="store_true",
        help="the sides of --floor and Keras' step on DDP in the same "
        "processes, in turns of "
        f"{BLOCK} steps (step times only)",
    )
    p.add_argument("--worker", nargs=2, metavar=("IMPL", "MODEL"))
    return p.parse_args()


def _peak_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(impl, kind, args):
    """One process of one job; prints `RESULT <json>` on process 0."""
    import torch
    import torch.distributed as dist

    from keras import distribution as kd

    torch.set_num_threads(1)
    kd.initialize()
    rank, size = dist.get_rank(), dist.get_world_size()
    if impl == "interleaved":
        return _interleaved(kind, args, rank, size)
    timed = args.phases and impl in ("keras_dp", "keras_alone")
    phase_totals = _timed_phases() if timed else {}
    model, step = weak_scaling_models.make_step(
        impl, kind, args.rows, rank, size
    )
    for _ in range(3):
        step()
    _reset_peak()
    before = _peak_kib()
    times, phases = [], {}
    for _ in range(args.steps):
        dist.barrier()
        phase_totals.clear()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        for label, seconds in phase_totals.items():
            phases.setdefault(label, []).append(seconds)
    peak = (_peak_kib() - before) * 1024
    per_step = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    peaks = [None] * size
    dist.all_gather_object(peaks, peak)
    path = _path(impl, kind, model, size)
    if rank == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "impl": impl,
                    "model": kind,
                    "procs": size,
                    "step_ms": statistics.median(per_step.tolist()) * 1e3,
                    "peak_mib": max(peaks) / MIB,
                    "path": path,
                    "phases_ms": {
                        label: statistics.median(values) * 1e3
                        for label, values in phases.items()
                    },
                }
            ),
            flush=True,
        )


def _path(impl, kind, model, size):
    """The path `impl`'s trained `model` took ("" off `DataParallel`)."""
    from keras.src.backend.torch.distributed.training.step import model_step

    if impl == "keras_dp" and kind.endswith("_mp"):
        return f"ModelParallel on ({size // 2}, 2)"
    if impl != "keras_dp":
        return ""
    verdict = model_step(model, "train").rows.verdicts[True]
    if not verdict.per_sample:
        return f"dtensor: {verdict.reason}"
    if verdict.coupled:
        return f"local, {len(verdict.coupled)} layer(s) on DTensor"
    return "local"


def _interleaved(kind, args, rank, size):
    """The sides (`IMPLS`, `FLOOR_IMPLS`, `STEP_DDP_IMPL`) in these same
    processes, in turn: blocks of `BLOCK` steps, each side under its own
    distribution, so that the machine's state changes alike for all.
    Prints a `RESULT` per side: its median step, the slowest process'."""
    import torch
    import torch.distributed as dist

    from keras import distribution as kd

    sides, models = {}, {}
    for impl in IMPLS + FLOOR_IMPLS + (STEP_DDP_IMPL,):
        models[impl], step = weak_scaling_models.make_step(
            impl, kind, args.rows, rank, size
        )
        sides[impl] = (kd.distribution(), step)
    times = {impl: [] for impl in sides}
    for _ in range(max(1, args.steps // BLOCK)):
        for impl, (distribution, step) in sides.items():
            kd.set_distribution(distribution)
            step()  # Untimed: the first after the switch (and the warm-up).
            for _ in range(BLOCK):
                dist.barrier()
                start = time.perf_counter()
                step()
                times[impl].append(time.perf_counter() - start)
    for impl, values in times.items():
        per_step = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
        result = {
            "impl": impl,
            "model": kind,
            "procs": size,
            "step_ms": statistics.median(per_step.tolist()) * 1e3,
            "path": _path(impl, kind, models[impl], size),
        }
        if rank == 0:
            print("RESULT " + json.dumps(result), flush=True)


# The parts of Keras' train step timed by `--phases`: (label, module,
# attribute path of the function).
PHASES = (
    (
        "the batch distributed",
        "keras.src.backend.torch.distributed.inputs.data_input",
        "distribute_global_batch",
    ),
    (
        "the batch cut to rows",
        "keras.src.backend.torch.distributed.data_parallel.row_boundary",
        "plain_rows",
    ),
    ("model calls", "keras.src.layers.layer", "Layer.__call__"),
    ("loss (Keras)", "keras.src.trainers.trainer", "Trainer._compute_loss"),
    (
        "loss (local rows)",
        "keras.src.backend.torch.distributed.training.step",
        "DistributedStep.local_compiled_loss",
    ),
    (
        "loss tracker update",
        "keras.src.metrics.reduction_metrics",
        "Mean.update_state",
    ),
    ("backward", "torch", "Tensor.backward"),
    (
        "bucket launches (in backward)",
        "keras.src.backend.torch.distributed.training.step_reduction",
        "OverlappedReduction._launch",
    ),
    (
        "gradients reduced",
        "keras.src.backend.torch.distributed.training.step",
        "DistributedStep.reduce_gradients",
    ),
    (
        "optimizer",
        "keras.src.backend.torch.optimizers.torch_optimizer",
        "TorchOptimizer.apply",
    ),
    ("metrics", "keras.src.trainers.trainer", "Trainer.compute_metrics"),
    (
        "train_step",
        "keras.src.backend.torch.trainer",
        "TorchTrainer.train_step",
    ),
)


def _timed_phases():
    """Wraps each of `PHASES`' functions to add its time to the returned
    dict of this step's seconds by label."""
    import importlib

    totals = {}

    def timed(function, label):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                totals[label] = totals.get(label, 0.0) + elapsed

        return wrapper

    for label, module, path in PHASES:
        owner = importlib.import_module(module)
        *owners, name = path.split(".")
        for part in owners:
            owner = getattr(owner, part)
        setattr(owner, name, timed(getattr(owner, name), label))
    return totals


def _print_phases(results):
    """The train step's parts, Keras alone and DataParallel, side by side."""
    alone = results["keras_alone"].get("phases_ms", {})
    dp = results["keras_dp"].get("phases_ms", {})
    print(f"      {'part of the step':<30} {'alone ms':>9} {'DP ms':>9}")
    for label, _, _ in PHASES:
        if label in alone or label in dp:
            print(
                f"      {label:<30} {alone.get(label, 0.0):>9.2f} "
                f"{dp.get(label, 0.0):>9.2f}"
            )
    for impl, phases in (("keras_alone", alone), ("keras_dp", dp)):
        step = results[impl]["step_ms"]
        print(
            f"      {impl}: step {step:.2f} ms, train_step "
            f"{phases.get('train_step', 0.0):.2f} ms"
        )


def _job(impl, kind, nproc, args):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        os.path.abspath(__file__),
        "--worker",
        impl,
        kind,
        "--rows",
        str(args.rows),
        "--steps",
        str(args.steps),
    ] + (["--phases"] if args.phases else [])
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    out = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=1200
    )
    results = [
        json.loads(line[len("RESULT ") :])
        for line in out.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    if results:
        return results
    raise RuntimeError(
        f"{impl} {kind} on {nproc} processes printed no result:\n"
        f"{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    )


def _jobs(kind, nproc, args):
    """Both sides' results on `nproc` processes: with `--repeats`, their
    jobs alternate, and each number is the median of the jobs'."""
    impls = IMPLS + (FLOOR_IMPLS if args.floor else ())
    impls += (STEP_DDP_IMPL,) if args.interleaved else ()
    runs = {impl: [] for impl in impls}
    for _ in range(args.repeats):
        if args.interleaved:
            for result in _job("interleaved", kind, nproc, args):
                runs[result["impl"]].append(result)
            continue
        for impl in impls:
            runs[impl] += _job(impl, kind, nproc, args)
    results = {}
    for impl, jobs in runs.items():
        result = dict(jobs[0])
        for key in ("step_ms", "peak_mib"):
            if key in result:
                result[key] = statistics.median(job[key] for job in jobs)
        labels = {label for job in jobs for label in job.get("phases_ms", {})}
        result["phases_ms"] = {
            label: statistics.median(
                job["phases_ms"].get(label, 0.0) for job in jobs
            )
            for label in labels
        }
        if len(jobs) > 1:
            result["step_ms_runs"] = [job["step_ms"] for job in jobs]
        results[impl] = result
    return results


def main():
    args = parse_args()
    if args.worker:
        return worker(*args.worker, args)
    args.floor = args.floor or args.interleaved
    print(
        f"rows per process {args.rows}, sequences {SEQUENCE} x {FEATURES}, "
        f"{args.steps} timed steps (median of the slowest process')"
    )
    for kind in args.models:
        # A (N/2, 2) mesh needs an even number of processes.
        procs = [
            n for n in args.procs if not kind.endswith("_mp") or n % 2 == 0
        ]
        results = {n: _jobs(kind, n, args) for n in procs}
        print(
            f"\n{kind} (DataParallel path: "
            f"{results[procs[-1]]['keras_dp']['path']})"
        )
        print(
            f"{'procs':>5} {'dp step ms':>11} {'ddp step ms':>12} "
            f"{'ratio':>6} {'dp peak MiB':>12} {'ddp peak MiB':>13} "
            f"{'ratio':>6}"
        )
        for n in procs:
            dp, ddp = results[n]["keras_dp"], results[n]["keras_ddp"]
            peaks = "(not measured interleaved)"
            if not args.interleaved:
                peaks = (
                    f"{dp['peak_mib']:>12.1f} {ddp['peak_mib']:>13.1f} "
                    f"{dp['peak_mib'] / max(ddp['peak_mib'], 1e-3):>6.2f}"
                )
            print(
                f"{n:>5} {dp['step_ms']:>11.1f} {ddp['step_ms']:>12.1f} "
                f"{dp['step_ms'] / ddp['step_ms']:>6.2f} {peaks}"
            )
            if args.floor:
                _print_floor(results[n])
            if args.interleaved:
                _print_step_ddp(results[n])
            if args.floor and args.phases:
                _print_phases(results[n])
            if args.repeats > 1:
                _print_repeats("step ratio of each repeat", dp, ddp)
            if args.repeats > 1 and args.interleaved:
                step_ddp = results[n][STEP_DDP_IMPL]
                _print_repeats("against Keras' step on DDP", dp, step_ddp)


def _print_repeats(label, dp, peer):
    """The `dp / peer` step ratio of each repeat."""
    ratios = [a / b for a, b in zip(dp["step_ms_runs"], peer["step_ms_runs"])]
    print(f"      {label}: " + ", ".join(f"{r:.2f}" for r in ratios))


def _print_step_ddp(results):
    """DataParallel against Keras' own step with its model called through
    DDP: what Keras master's torch trainer runs, in the same processes."""
    dp = results["keras_dp"]["step_ms"]
    step_ddp = results[STEP_DDP_IMPL]["step_ms"]
    print(
        f"      Keras' train_on_batch, its model called through DDP: "
        f"{step_ddp:.1f} ms; DataParallel / it {dp / step_ddp:.2f}"
    )


def _print_floor(results):
    """The ratio's floor: Keras' own step cost over the loop's, on DDP."""
    ddp = results["keras_ddp"]["step_ms"]
    keras_alone = results["keras_alone"]["step_ms"]
    loop_alone = results["loop_alone"]["step_ms"]
    floor = (ddp + keras_alone - loop_alone) / ddp
    print(
        f"      alone, no communication: Keras {keras_alone:.1f} ms, "
        f"loop {loop_alone:.1f} ms; floor {floor:.2f}; "
        f"DataParallel over Keras alone "
        f"+{results['keras_dp']['step_ms'] - keras_alone:.1f} ms"
    )


if __name__ == "__main__":
    main()
