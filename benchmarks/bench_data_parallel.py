"""Keras `DataParallel` against torch DDP and one process, side by side.

Launch with torchrun (2 CPU processes on gloo here)::

    torchrun --standalone --nproc_per_node=2 \\
        benchmarks/bench_data_parallel.py --model cnn --rounds 20

The classic data-parallel workloads, each trained four ways on the same
global batch, interleaved round by round so that machine drift hits all
alike:

* ``keras_dp``: Keras ``DataParallel``, ``train_on_batch`` on the global
  batch, every process;
* ``torch_ddp``: ``DistributedDataParallel``, each process its share of
  the batch;
* ``keras_one`` / ``torch_one``: the same model and global batch in one
  process (process 0, while the others wait at a barrier).

Models (``--model``): ``cnn`` is ``[Conv2D(32, 3) -> BatchNormalization ->
ReLU] x 2 -> GlobalAveragePooling2D -> Dense(10)`` on 16x16x3 images;
``resnet`` a residual block (two convolutions with batch normalization and
a skip connection) on the same images; ``lstm`` ``LSTM(64) -> Dense(10)``
on 20 steps of 16 features. SGD, sparse categorical cross-entropy, global
batch 64.

Keras' batch normalization takes its moments over the global batch (as
torch's ``SyncBatchNorm``, which runs on CUDA only); DDP's over each
process' share. A step is timed from a barrier until it returns; a step's
time is its slowest process'. Process 0 prints the medians and the ratios
the target is stated in: ``keras_dp / torch_ddp`` against the floor
``keras_one / torch_one``, and ``keras_dp / keras_one``, then the largest
relative gap between ``keras_dp``'s and ``keras_one``'s losses, step by
step (both train the same model on the same batch, the same number of
steps): `DataParallel` must give one process' numbers.

``--jit-compile`` compiles every step: Keras' ``jit_compile=True`` (under
`DataParallel`, `compiled_step`), the torch models through
``torch.compile`` (DDP's too); the warmup steps compile.
"""

import argparse
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402

IMAGE = (16, 16, 3)
SEQUENCE = (20, 16)
CLASSES = 10


def keras_model(kind):
    """The Keras model of `kind`, seeded."""
    keras.utils.set_random_seed(0)
    layers = keras.layers
    if kind == "lstm":
        inputs = keras.Input(SEQUENCE)
        outputs = layers.Dense(CLASSES)(layers.LSTM(64)(inputs))
        return keras.Model(inputs, outputs)
    inputs = keras.Input(IMAGE)
    x = inputs
    if kind == "cnn":
        for _ in range(2):
            x = layers.Conv2D(32, 3)(x)
            x = layers.ReLU()(layers.BatchNormalization()(x))
    else:
        x = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(32, 3)(x)))
        y = layers.Conv2D(32, 3, padding="same")(x)
        y = layers.ReLU()(layers.BatchNormalization()(y))
        y = layers.Conv2D(32, 3, padding="same")(y)
        x = layers.ReLU()(layers.Add()([x, layers.BatchNormalization()(y)]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(CLASSES)(x))


class _TorchResidual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = _conv_block(3, 32, padding=0)
        self.block = torch.nn.Sequential(
            _conv_block(32, 32, padding=1),
            torch.nn.Conv2d(32, 32, 3, padding=1),
            torch.nn.BatchNorm2d(32),
        )
        self.head = torch.nn.Sequential(
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(32, CLASSES),
        )

    def forward(self, x):
        x = self.stem(x)
        return self.head(torch.relu(x + self.block(x)))


class _TorchLSTM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(SEQUENCE[1], 64, batch_first=True)
        self.head = torch.nn.Linear(64, CLASSES)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


def _conv_block(channels_in, channels_out, padding):
    return torch.nn.Sequential(
        torch.nn.Conv2d(channels_in, channels_out, 3, padding=padding),
        torch.nn.BatchNorm2d(channels_out),
        torch.nn.ReLU(),
    )


def torch_model(kind):
    """The torch equivalent of `keras_model(kind)` (channels first)."""
    torch.manual_seed(0)
    if kind == "lstm":
        return _TorchLSTM()
    if kind == "resnet":
        return _TorchResidual()
    return torch.nn.Sequential(
        _conv_block(3, 32, padding=0),
        _conv_block(32, 32, padding=0),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, CLASSES),
    )


def data(kind, batch):
    """A global batch `(x, y)` in Keras' layout, the same on every rank."""
    rng = np.random.default_rng(0)
    shape = SEQUENCE if kind == "lstm" else IMAGE
    x = rng.normal(size=(batch,) + shape).astype("float32")
    y = rng.integers(0, CLASSES, size=(batch,)).astype("int64")
    return x, y


def keras_step(kind, x, y, distribution, jit_compile=False):
    """A function running one Keras train step, under `distribution`
    (`jit_compile`: the step compiled by `torch.compile`)."""
    with distribution.scope() if distribution else _nothing():
        model = keras_model(kind)
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )

    def step():
        with distribution.scope() if distribution else _nothing():
            return model.train_on_batch(x, y)

    return step


def torch_step(kind, x, y, ddp, jit_compile=False):
    """A function running one torch train step (DDP on this rank's rows;
    `jit_compile`: the model compiled by `torch.compile`, as Keras'
    `jit_compile=True` compiles its step)."""
    model = torch_model(kind)
    if kind != "lstm":
        x = np.transpose(x, (0, 3, 1, 2))
    x, y = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)
    if ddp:
        rows = np.array_split(np.arange(len(y)), dist.get_world_size())
        rows = torch.from_numpy(rows[dist.get_rank()])
        x, y = x[rows], y[rows]
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_function = torch.nn.CrossEntropyLoss()
    if jit_compile:
        model = torch.compile(model, dynamic=False)

    def step():
        optimizer.zero_grad()
        loss_function(model(x), y).backward()
        optimizer.step()

    return step


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *args):
        return False


def timed(step, alone, results=None):
    """One step's wall time, the slowest rank's (`alone`: process 0 runs,
    the others wait); what the step returned is appended to `results`."""
    dist.barrier()
    start = time.perf_counter()
    if not alone or dist.get_rank() == 0:
        result = step()
        if results is not None:
            results.append(result)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", choices=("cnn", "resnet", "lstm", "all"), default="all"
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--jit-compile",
        action="store_true",
        help="compiled steps: Keras' `jit_compile=True`, `torch.compile`d "
        "torch models (DDP included), compiled in the warmup steps",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    keras.distribution.initialize()
    kinds = ("cnn", "resnet", "lstm") if args.model == "all" else (args.model,)
    for kind in kinds:
        x, y = data(kind, args.batch)
        dp = keras.distribution.DataParallel()
        jit = args.jit_compile
        steps = {
            "keras_dp": (keras_step(kind, x, y, dp, jit), False),
            "torch_ddp": (torch_step(kind, x, y, True, jit), False),
            "keras_one": (keras_step(kind, x, y, None, jit), True),
            "torch_one": (torch_step(kind, x, y, False, jit), True),
        }
        # Each Keras model's losses, step by step: DataParallel's must be
        # one process'.
        losses = {"keras_dp": [], "keras_one": []}
        for name, (step, alone) in steps.items():
            for _ in range(args.warmup):
                timed(step, alone, losses.get(name))
        times = {name: [] for name in steps}
        names = list(steps)
        for r in range(args.rounds):
            # Rotated order: no implementation always runs first.
            for name in names[r % len(names) :] + names[: r % len(names)]:
                step, alone = steps[name]
                times[name] += [
                    timed(step, alone, losses.get(name))
                    for _ in range(args.steps)
                ]
        if dist.get_rank() == 0:
            _report(kind, args, times, losses)


def _report(kind, args, times, losses):
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(
        f"model={kind} world_size={dist.get_world_size()} "
        f"batch={args.batch} rounds={args.rounds} "
        f"jit_compile={args.jit_compile} torch={torch.__version__} "
        f"load={[round(v, 2) for v in os.getloadavg()]}"
    )
    for name, value in median.items():
        print(f"  {name:10s} median {value:7.2f} ms")
    floor = median["keras_one"] / median["torch_one"]
    over_ddp = median["keras_dp"] / median["torch_ddp"]
    print(
        f"  keras_dp / torch_ddp {over_ddp:.2f}x; floor keras_one / "
        f"torch_one {floor:.2f}x (target <= {floor * 1.05:.2f}x); "
        f"keras_dp / keras_one {median['keras_dp'] / median['keras_one']:.2f}x"
    )
    dp, one = np.array(losses["keras_dp"]), np.array(losses["keras_one"])
    gap = float(np.max(np.abs(dp - one) / np.maximum(np.abs(one), 1e-12)))
    print(
        f"  losses: keras_dp last {dp[-1]:.6f}, keras_one last {one[-1]:.6f}; "
        f"largest relative gap over {len(one)} steps {gap:.1e}"
    )


if __name__ == "__main__":
    main()
