"""Saving and loading a sharded model: DCP checkpoints against `.weights.h5`.

Launch with torchrun on 2 (or more) ranks::

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_checkpoint.py
    ./run_multi_gpu.sh benchmarks/bench_checkpoint.py --layers 4 --dim 1024

Builds the model of `bench_memory.py` (defaults: 16 Dense kernels of
4096 x 4096 float32, sharded ``(None, "model")`` on a ``(1, N)`` mesh: 1 GiB)
and times, in `--repeats` interleaved rounds:

* `dcp_save`: `keras.callbacks.DistributedCheckpoint` (weights only,
  synchronous): every rank writes its own shards.
* `dcp_save_background`: the same with `save_on_background=True`; the time
  is until the save returns (the values staged in host memory), and
  `dcp_background_done` until `wait_until_finished()` returns.
* `dcp_load`: `model.load_weights(directory)` of that checkpoint.
* `h5_save`: `model.save_weights("x.weights.h5")`: every variable gathered
  whole, process 0 writes the file.
* `h5_load`: `model.load_weights("x.weights.h5")`: every rank reads the file.

A time is the slowest rank's, from a barrier until the operation returned
on every rank. Each rank's peak resident memory increase during the
operation is the kernel's high-water mark (VmHWM, reset right before it by
writing 5 to /proc/self/clear_refs) minus the RSS before it. The checkpoint
files are written under `--dir` (a temporary directory by default, deleted
after): both formats read back what was just written, from the page cache
as much as the machine has room.

Rank 0 prints a table of medians and the h5 / DCP ratios; `--json PATH`
writes every number.
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_memory import MIB  # noqa: E402
from bench_memory import build_model  # noqa: E402
from bench_memory import global_bytes  # noqa: E402
from bench_memory import local_bytes  # noqa: E402
from bench_memory import memory_kib  # noqa: E402
from bench_memory import model_parallel  # noqa: E402
from bench_memory import reset_peak  # noqa: E402

import keras  # noqa: E402

OPERATIONS = (
    "dcp_save",
    "dcp_save_background",
    "dcp_background_done",
    "dcp_load",
    "h5_save",
    "h5_load",
)


def parse_args(argv=None):
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16, help="Dense layers")
    p.add_argument(
        "--dim", type=int, default=4096, help="kernel size: dim x dim float32"
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds")
    p.add_argument(
        "--dir", help="where the files go (default: a temporary directory)"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads per rank"
    )
    p.add_argument("--json", metavar="PATH", help="write the results here")
    return p.parse_args(argv)


def timed(operation):
    """Runs `operation()` on every rank; returns (seconds, peak increase).

    Seconds are this rank's, from a barrier until every rank finished.
    """
    gc.collect()
    dist.barrier()
    reset_peak()
    rss_before, _ = memory_kib()
    start = time.perf_counter()
    operation()
    dist.barrier()
    seconds = time.perf_counter() - start
    _, peak = memory_kib()
    return seconds, (peak - rss_before) * 1024


def callbacks(model, directory):
    """A synchronous and a background `DistributedCheckpoint` of `model`."""
    made = []
    for background in (False, True):
        callback = keras.callbacks.DistributedCheckpoint(
            os.path.join(directory, "dcp"),
            save_weights_only=True,
            save_on_background=background,
        )
        callback.set_model(model)
        made.append(callback)
    return made


def run_round(model, directory, checkpoints, step):
    """One save and load of each kind; returns {operation: (s, bytes)}."""
    sync, background = checkpoints
    h5_path = os.path.join(directory, "model.weights.h5")
    return {
        "dcp_save": timed(lambda: sync.on_epoch_end(2 * step)),
        "dcp_save_background": timed(
            lambda: background.on_epoch_end(2 * step + 1)
        ),
        "dcp_background_done": timed(background.wait_until_finished),
        "dcp_load": timed(lambda: model.load_weights(sync.directory)),
        "h5_save": timed(lambda: model.save_weights(h5_path)),
        "h5_load": timed(lambda: model.load_weights(h5_path)),
    }


def measure(args, directory):
    """Every round's numbers on this rank."""
    # Warm-up: lazy imports, the background saves' process group.
    warm = build_model(2, 64)
    warm_dir = os.path.join(directory, "warm")
    run_round(warm, warm_dir, callbacks(warm, warm_dir), 0)
    del warm
    model = build_model(args.layers, args.dim)
    checkpoints = callbacks(model, directory)
    rounds = [
        run_round(model, directory, checkpoints, r) for r in range(args.repeats)
    ]
    return {
        "rank": dist.get_rank(),
        "rounds": rounds,
        "own_shards": sum(local_bytes(v) for v in model.weights),
        "largest_variable": max(global_bytes(v) for v in model.weights),
        "global_total": sum(global_bytes(v) for v in model.weights),
        "peak_reset": reset_peak(),
    }


def summarize(results):
    """Medians per operation: slowest rank's time, each rank's peak."""
    summary = {}
    for op in OPERATIONS:
        times = [
            max(r["rounds"][i][op][0] for r in results)
            for i in range(len(results[0]["rounds"]))
        ]
        summary[op] = {
            "median_s": statistics.median(times),
            "min_s": min(times),
            "peak_increase": [
                statistics.median(x[op][1] for x in r["rounds"])
                for r in results
            ],
        }
    return summary


def report(results, summary, args):
    """The lines rank 0 prints."""
    first = results[0]
    ranks = range(len(results))
    lines = [
        f"Model: {args.layers} Dense kernels of {args.dim}x{args.dim} "
        f"float32, sharded (None, 'model') over {len(results)} ranks; "
        f"global total {first['global_total'] / MIB:.1f} MiB, own shards "
        f"{first['own_shards'] / MIB:.1f} MiB per rank; "
        f"{args.repeats} rounds",
        f"{'operation':<21}{'median s':>10}{'min s':>9}"
        + "".join(f"{f'peak+MiB r{i}':>15}" for i in ranks),
    ]
    for op in OPERATIONS:
        s = summary[op]
        lines.append(
            f"{op:<21}{s['median_s']:>10.3f}{s['min_s']:>9.3f}"
            + "".join(f"{p / MIB:>15.1f}" for p in s["peak_increase"])
        )
    for kind in ("save", "load"):
        h5, dcp = summary[f"h5_{kind}"], summary[f"dcp_{kind}"]
        lines.append(
            f"h5 / dcp {kind}: time {h5['median_s'] / dcp['median_s']:.2f}x;"
            f" largest peak +{max(h5['peak_increase']) / MIB:.1f} MiB (h5)"
            f" vs +{max(dcp['peak_increase']) / MIB:.1f} MiB (dcp)"
        )
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    keras.distribution.initialize()
    keras.distribution.set_distribution(model_parallel())
    owned = args.dir is None
    directory = [args.dir]
    if owned:
        if dist.get_rank() == 0:
            directory = [tempfile.mkdtemp(prefix="bench-ckpt-")]
        dist.broadcast_object_list(directory, src=0)
    directory = directory[0]
    try:
        mine = measure(args, directory)
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, mine)
    finally:
        dist.barrier()
        if owned and dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
    if dist.get_rank() == 0:
        summary = summarize(results)
        sys.stdout.write(report(results, summary, args) + "\n")
        sys.stdout.flush()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {"args": vars(args), "summary": summary, "ranks": results},
                    f,
                    indent=1,
                )
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
