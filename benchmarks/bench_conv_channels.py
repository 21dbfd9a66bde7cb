"""Convolutions whose kernels are sharded on their output channels: each
process' channels (`shard_local.local_conv`) against the kernel gathered and
the whole convolution computed on every process (`conv_operands`, what the
layer did before, and what it still does where the layout does not split).

Two `Conv2D(128, 3)` layers on (16, 32, 32, 32) inputs and a `Dense(10)`
head, `ModelParallel` on a (1, N) ("batch", "model") mesh with both kernels
and biases sharded over "model", Adam, `train_on_batch` on one batch; per
setting, the median step over the last 10 of 12 and the growth of the
process' peak resident memory over them (process 0). Gloo, one CPU thread a
process:

    python benchmarks/bench_conv_channels.py --processes 1,2,4 --repeat 2

`--worker MODE` is one process of a run (under `torchrun`).
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np


def _worker(mode):
    import torch

    torch.set_num_threads(1)
    import keras
    from keras.src.backend.torch.distributed.tensor_parallel import shard_local

    if mode == "gathered":
        # No layout splits: the kernel is gathered (`conv_operands`).
        shard_local._shard_local_einsum = lambda *args: None
    keras.distribution.initialize()
    n = int(os.environ["WORLD_SIZE"])
    mesh = keras.distribution.DeviceMesh((1, n), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["conv\\d/kernel"] = (None, None, None, "model")
    layout_map["conv\\d/bias"] = ("model",)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    inputs = keras.Input((32, 32, 32))
    x = keras.layers.Conv2D(128, 3, padding="same", name="conv1")(inputs)
    x = keras.layers.Conv2D(128, 3, padding="same", name="conv2")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inputs, keras.layers.Dense(10)(x))
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 32, 32, 32)).astype("float32")
    y = rng.normal(size=(16, 10)).astype("float32")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(12):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if int(os.environ["RANK"]) == 0:
        step = 1e3 * statistics.median(times[2:])
        print(f"RESULT {step:.1f} {(after - before) / 1024:.1f}")


def _run(mode, processes):
    """`(step ms, peak memory growth MiB)` of one run."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        os.path.abspath(__file__),
        "--worker",
        mode,
    ]
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=600
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            step, memory = line.split()[1:]
            return float(step), float(memory)
    raise RuntimeError(f"{mode} on {processes} processes:\n{done.stderr}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=("by_channels", "gathered"))
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    if args.worker:
        return _worker(args.worker)
    print("| processes | by channels: step ms, memory MiB | gathered | ratio |")
    print("| --- | --- | --- | --- |")
    for n in [int(p) for p in args.processes.split(",")]:
        runs = {"by_channels": [], "gathered": []}
        for _ in range(args.repeat):  # Alternated.
            for mode in runs:
                runs[mode].append(_run(mode, n))
        cells = {
            mode: [statistics.median(v) for v in zip(*values)]
            for mode, values in runs.items()
        }
        ratio = cells["gathered"][0] / cells["by_channels"][0]
        a, b = cells["by_channels"], cells["gathered"]
        print(
            f"| {n} | {a[0]:.1f}, {a[1]:.1f} | {b[0]:.1f}, {b[1]:.1f} "
            f"| {ratio:.2f}x |"
        )


if __name__ == "__main__":
    main()
