"""What agreeing on collective calls costs a training step and a read.

Launch with torchrun on 2 (or more) processes::

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_call_agreement.py

A `Dense` stack under `ModelParallel` (kernels split over the `model`
axis of a (1, N) mesh). In one run, side by side, medians of `--rounds`
rounds:

- a training step (`train_on_batch`) while the watcher thread of the call
  agreement runs, then after it is stopped (the announcement path itself
  is not on a step's path: nothing is announced per step);
- a read of one sharded kernel's global value through Keras (announced
  in the job's store, then gathered) against DTensor's own
  `full_tensor()` (the gather alone).

Process 0 prints one line per measure and the ratios.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import keras  # noqa: E402
from keras import distribution as kd  # noqa: E402
from keras.src.backend.torch.distributed.health import call_agreement  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=512, help="kernel size")
    p.add_argument("--layers", type=int, default=4, help="Dense layers")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--rounds", type=int, default=5, help="rounds (median)")
    p.add_argument("--steps", type=int, default=20, help="steps a round")
    p.add_argument("--reads", type=int, default=20, help="reads a round")
    return p.parse_args()


def _model(args):
    world = int(os.environ.get("WORLD_SIZE", 1))
    mesh = kd.DeviceMesh((1, world), ["batch", "model"], kd.list_devices())
    layout_map = kd.LayoutMap(mesh)
    layout_map[".*kernel"] = (None, "model")
    kd.set_distribution(
        kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((args.dim,))]
        + [keras.layers.Dense(args.dim) for _ in range(args.layers)]
    )
    model.compile(optimizer="adam", loss="mse")
    return model


def _per_call(function, count):
    torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(count):
        function()
    return (time.perf_counter() - start) / count * 1e3


def _median(function, count, rounds):
    return statistics.median(_per_call(function, count) for _ in range(rounds))


def main():
    args = parse_args()
    torch.set_num_threads(1)
    kd.initialize()
    model = _model(args)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, args.dim)).astype("float32")
    y = rng.normal(size=(args.batch, args.dim)).astype("float32")
    model.train_on_batch(x, y)
    kernel = model.layers[0].kernel
    step = lambda: model.train_on_batch(x, y)  # noqa: E731
    keras_read = lambda: kernel.numpy()  # noqa: E731
    dtensor_read = lambda: kernel.value.full_tensor()  # noqa: E731
    results = {}
    for _ in range(args.rounds):
        # Interleaved, so that the machine's load moves both alike.
        results.setdefault("read: Keras (announced)", []).append(
            _per_call(keras_read, args.reads)
        )
        results.setdefault("read: full_tensor()", []).append(
            _per_call(dtensor_read, args.reads)
        )
    step_with = _median(step, args.steps, args.rounds)
    call_agreement.stop("the end of the benchmark's first half")
    step_without = _median(step, args.steps, args.rounds)
    if torch.distributed.get_rank() != 0:
        return
    reads = {k: statistics.median(v) for k, v in results.items()}
    print(f"processes: {torch.distributed.get_world_size()}")
    print(f"train step, watcher running:  {step_with:8.3f} ms")
    print(f"train step, watcher stopped:  {step_without:8.3f} ms")
    print(f"  ratio {step_with / step_without:.3f}")
    for name, value in reads.items():
        print(f"{name:30s} {value:8.3f} ms")
    ratio = reads["read: Keras (announced)"] / reads["read: full_tensor()"]
    added = reads["read: Keras (announced)"] - reads["read: full_tensor()"]
    print(f"  ratio {ratio:.3f} (+{added:.3f} ms a read)")


if __name__ == "__main__":
    main()
