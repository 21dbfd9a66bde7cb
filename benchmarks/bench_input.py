"""Input pipelines under DataParallel: what each process reads, epoch time.

Fits a small model on a `keras.utils.PyDataset` and on a map-style
`torch.utils.data.DataLoader` whose every sample costs `--ms-per-sample` of
loading work, once in 1 process and once in N (torchrun, `DataParallel`),
and reports per source: the samples each process read during `fit` (one
epoch plus Keras' peek at the first batch, which builds the model), the
epoch time (median over `--repeats` fits after an untimed one, slowest
process), and for the `PyDataset` the time spent exchanging rows.

    python benchmarks/bench_input.py                # 1 vs 2 processes
    python benchmarks/bench_input.py --nproc 4 --work spin --json in.json

`--work sleep` (default) models loading that waits (disk, network);
`--work spin` keeps the CPU busy (decoding), which needs a free core per
process to show its speed-up.
"""

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ms-per-sample", type=float, default=2.0)
    parser.add_argument("--work", choices=("sleep", "spin"), default="sleep")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loader-workers", type=int, default=0)
    parser.add_argument("--pydataset-workers", type=int, default=1)
    parser.add_argument("--sources", default="pydataset,dataloader")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also time each source with no loading work (0 ms/sample)",
    )
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ------------------------------------------------------------ on each rank


def _work(args):
    seconds = args.ms_per_sample / 1000.0
    if args.work == "sleep":
        return lambda n: time.sleep(seconds * n)

    def spin(n):
        end = time.perf_counter() + seconds * n
        while time.perf_counter() < end:
            pass

    return spin


def _sources(args, counter):
    """`{name: (source factory)}`; each source counts the samples it reads."""
    import numpy as np
    import torch

    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, 32)).astype("float32")
    y = rng.normal(size=(args.samples, 1)).astype("float32")
    work = _work(args)

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return args.samples

        def __getitem__(self, i):
            work(1)
            with counter.get_lock():  # Also counts in loader workers.
                counter.value += 1
            return x[i], y[i]

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return -(-args.samples // args.batch)

        def __getitem__(self, i):
            rows = slice(i * args.batch, (i + 1) * args.batch)
            work(len(x[rows]))
            with counter.get_lock():
                counter.value += len(x[rows])
            return x[rows], y[rows]

    return {
        "pydataset": lambda: Batches(workers=args.pydataset_workers),
        "dataloader": lambda: torch.utils.data.DataLoader(
            Samples(), batch_size=args.batch, num_workers=args.loader_workers
        ),
    }


def _timed_exchange(times):
    """Times `PyDatasetShares._scatter_rows` (the rows exchange)."""
    from keras.src.backend.torch.distributed.inputs import pydataset_shares

    shares = getattr(pydataset_shares, "PyDatasetShares", None)
    if shares is None:
        return
    scatter = shares._scatter_rows

    def timed(self, batch, src):
        start = time.perf_counter()
        try:
            return scatter(self, batch, src)
        finally:
            times.append(time.perf_counter() - start)

    shares._scatter_rows = timed


class _EpochTimer:
    def __init__(self):
        import keras

        class Timer(keras.callbacks.Callback):
            def on_epoch_begin(self_, epoch, logs=None):
                self_.start = time.perf_counter()

            def on_epoch_end(self_, epoch, logs=None):
                self.seconds = time.perf_counter() - self_.start

        self.callback = Timer()
        self.seconds = None


def _fit_once(source, timer):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(16), keras.layers.Dense(1)]
    )
    model.compile(optimizer="adam", loss="mse")
    model.fit(source, epochs=1, verbose=0, callbacks=[timer.callback])
    return timer.seconds


def _measure(args, name, counter, exchange):
    """Epoch times, samples read and exchange times of `repeats` fits."""
    import torch.distributed as dist

    import keras

    make = _sources(args, counter)[name]
    epochs, reads, exchanges = [], [], []
    # The first fit warms up one-off costs (DTensor's caches); untimed.
    for repeat in range(args.repeats + 1):
        keras.backend.clear_session()
        counter.value, exchange[:] = 0, []
        dist.barrier()
        seconds = _fit_once(make(), _EpochTimer())
        if repeat:
            epochs.append(seconds)
            reads.append(counter.value)
            exchanges.append(sum(exchange))
    return {"epoch_s": epochs, "read": reads, "exchange_s": exchanges}


def worker(args):
    import torch.distributed as dist

    import keras

    keras.distribution.initialize()
    world = dist.get_world_size()
    if world > 1:
        keras.distribution.set_distribution(keras.distribution.DataParallel())
    exchange = []
    _timed_exchange(exchange)
    counter = multiprocessing.Value("q", 0)
    results = {}
    for name in args.sources.split(","):
        results[name] = _measure(args, name, counter, exchange)
        if args.floor:
            no_work = argparse.Namespace(**{**vars(args), "ms_per_sample": 0})
            floor = _measure(no_work, name, counter, exchange)
            results[name]["floor_s"] = floor["epoch_s"]
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"world": world, "ranks": gathered}, f)


# ------------------------------------------------------------ driver


def _run(args, nproc, out):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        __file__,
        *sys.argv[1:],
        "--worker-out",
        out,
    ]
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    subprocess.run(command, check=True, env=env)
    with open(out) as f:
        return json.load(f)


def summarize(run):
    """Per source: reads per rank (median), epoch s (slowest rank)."""
    summary = {}
    for name in run["ranks"][0]:
        per_rank = [r[name] for r in run["ranks"]]
        epochs = [max(e) for e in zip(*(r["epoch_s"] for r in per_rank))]
        summary[name] = {
            "read_per_rank": [statistics.median(r["read"]) for r in per_rank],
            "epoch_s": statistics.median(epochs),
            "epoch_s_all": epochs,
            "exchange_s": max(
                statistics.median(r["exchange_s"]) for r in per_rank
            ),
        }
        if "floor_s" in per_rank[0]:
            floors = [max(e) for e in zip(*(r["floor_s"] for r in per_rank))]
            summary[name]["floor_s"] = statistics.median(floors)
    return summary


def report(args, one, many):
    lines = [
        f"{args.samples} samples, batch {args.batch}, "
        f"{args.ms_per_sample} ms/sample ({args.work}), "
        f"load average {[round(x, 1) for x in os.getloadavg()]}",
        f"| source | 1 process reads | {args.nproc} processes, each reads "
        f"| epoch 1 -> {args.nproc} processes | ratio | exchange / epoch |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in one:
        a, b = one[name], many[name]
        reads = ", ".join(str(int(n)) for n in b["read_per_rank"])
        lines.append(
            f"| {name} | {int(a['read_per_rank'][0])} | {reads} "
            f"| {a['epoch_s']:.2f} s -> {b['epoch_s']:.2f} s "
            f"| {b['epoch_s'] / a['epoch_s']:.2f}x "
            f"| {b['exchange_s'] * 1000:.0f} ms |"
        )
    if "floor_s" in next(iter(one.values())):
        lines += [
            "",
            "Loading part: epoch minus the epoch with no loading work "
            "(0 ms/sample, the floor)",
            f"| source | floor 1 -> {args.nproc} processes "
            f"| loading part 1 -> {args.nproc} processes | ratio |",
            "| --- | --- | --- | --- |",
        ]
        for name in one:
            a, b = one[name], many[name]
            load_a = a["epoch_s"] - a["floor_s"]
            load_b = b["epoch_s"] - b["floor_s"]
            lines.append(
                f"| {name} | {a['floor_s']:.2f} s -> {b['floor_s']:.2f} s "
                f"| {load_a:.2f} s -> {load_b:.2f} s "
                f"| {load_b / load_a:.2f}x |"
            )
    return "\n".join(lines)


def main():
    args = parse_args()
    if args.worker_out:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        one = summarize(_run(args, 1, os.path.join(tmp, "1.json")))
        many = summarize(_run(args, args.nproc, os.path.join(tmp, "n.json")))
    print(report(args, one, many))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "1": one, str(args.nproc): many}, f)


if __name__ == "__main__":
    main()
