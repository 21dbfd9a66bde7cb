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
  process (process 0, while the others wait at a barrier);
* ``torch_ddp_sync`` (models with batch normalization): DDP with batch
  normalization over the global batch, as Keras computes it: torch's
  ``SyncBatchNorm`` refuses CPU tensors, so `_GlobalBatchNorm2d` does what
  it does on CUDA (one all-reduce of packed sums forward, one of their
  gradients backward). Its losses are checked against ``torch_one``'s:
  native PyTorch computing one process' numbers.

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

On a machine with GPUs every model and batch is on the process' GPU (the
one Keras uses), and a step's time includes waiting for its kernels.

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


class _AllReduce(torch.autograd.Function):
    """A sum over processes; its gradient, the sum of theirs."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _GlobalBatchNorm2d(torch.nn.BatchNorm2d):
    """`BatchNorm2d` over the global batch of all processes' rows."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        channels, dims = x.shape[1], (0, 2, 3)
        count = x.new_full((1,), x.numel() / channels)
        packed = _AllReduce.apply(
            torch.cat([x.sum(dims), (x * x).sum(dims), count])
        )
        n = packed[-1]
        mean = packed[:channels] / n
        variance = packed[channels : 2 * channels] / n - mean * mean
        with torch.no_grad():
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(variance * n / (n - 1), self.momentum)
            self.num_batches_tracked += 1
        shape = (1, channels, 1, 1)
        normalized = (x - mean.view(shape)) * torch.rsqrt(
            variance.view(shape) + self.eps
        )
        return normalized * self.weight.view(shape) + self.bias.view(shape)


def _with_global_batch_norm(module):
    """`module` with each `BatchNorm2d` replaced by `_GlobalBatchNorm2d`
    (same parameters and state)."""
    for name, child in module.named_children():
        if isinstance(child, torch.nn.BatchNorm2d):
            replacement = _GlobalBatchNorm2d(child.num_features)
            replacement.load_state_dict(child.state_dict())
            setattr(module, name, replacement)
        else:
            _with_global_batch_norm(child)
    return module


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


def torch_step(kind, x, y, ddp, jit_compile=False, global_batch_norm=False):
    """A function running one torch train step (DDP on this rank's rows;
    `jit_compile`: the model compiled by `torch.compile`, as Keras'
    `jit_compile=True` compiles its step; `global_batch_norm`: batch
    normalization over every process' rows). It returns the loss of its
    rows, detached."""
    model = torch_model(kind)
    if global_batch_norm:
        model = _with_global_batch_norm(model)
    device = _device()
    model = model.to(device)
    if kind != "lstm":
        x = np.transpose(x, (0, 3, 1, 2))
    x, y = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)
    if ddp:
        rows = np.array_split(np.arange(len(y)), dist.get_world_size())
        rows = torch.from_numpy(rows[dist.get_rank()])
        x, y = x[rows], y[rows]
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    x, y = x.to(device), y.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_function = torch.nn.CrossEntropyLoss()
    if jit_compile:
        model = torch.compile(model, dynamic=False)

    def step():
        optimizer.zero_grad()
        loss = loss_function(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def _device():
    """Where the torch models train: the GPU Keras uses on this process
    (set by `keras.distribution.initialize`), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
    if torch.cuda.is_available():
        # A torch step returns before its kernels end.
        torch.cuda.synchronize()
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
        if kind != "lstm":
            steps["torch_ddp_sync"] = (
                torch_step(kind, x, y, True, jit, global_batch_norm=True),
                False,
            )
        # Each model's losses, step by step: DataParallel's must be one
        # process', and so must DDP's with global batch normalization.
        losses = {
            "keras_dp": [],
            "keras_one": [],
            "torch_one": [],
            "torch_ddp_sync": [],
        }
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
        if losses["torch_ddp_sync"]:
            # Each process' loss is the mean over its (equal) share of rows.
            synced = torch.stack(losses["torch_ddp_sync"])
            dist.all_reduce(synced)
            losses["torch_ddp_sync"] = list(synced / dist.get_world_size())
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
    if "torch_ddp_sync" in median:
        sync_cost = median["torch_ddp_sync"] / median["torch_ddp"]
        over_sync = median["keras_dp"] / median["torch_ddp_sync"]
        print(
            f"  keras_dp / torch_ddp_sync {over_sync:.2f}x "
            f"(the same numbers; floor {floor:.2f}x); global batch "
            f"normalization costs DDP {sync_cost:.2f}x"
        )
    pairs = [("keras_dp", "keras_one")]
    if losses["torch_ddp_sync"]:
        pairs.append(("torch_ddp_sync", "torch_one"))
    for name, reference in pairs:
        dp = np.array([float(v) for v in losses[name]])
        one = np.array([float(v) for v in losses[reference]])
        gap = float(np.max(np.abs(dp - one) / np.maximum(np.abs(one), 1e-12)))
        print(
            f"  losses: {name} last {dp[-1]:.6f}, {reference} last "
            f"{one[-1]:.6f}; largest relative gap over {len(one)} steps "
            f"{gap:.1e}"
        )


if __name__ == "__main__":
    main()
