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
"""

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import (  # noqa: E402
    default_hooks,
)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel  # noqa: E402
from torch.distributed.tensor.parallel import RowwiseParallel  # noqa: E402
from torch.distributed.tensor.parallel import parallelize_module  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402
from torch.nn.attention import sdpa_kernel  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import keras  # noqa: E402
from keras.src.backend.torch import distribution_trainer  # noqa: E402

MODELS = ("mlp", "transformer")
EAGER_IMPLS = ("keras_mp", "native_tp", "keras_dp", "native_ddp")
LOCAL_IMPLS = (
    "keras_local_tp",
    "native_local_tp",
    "keras_local_dp",
    "native_local_dp",
)
COMPILED_IMPLS = (
    "keras_mp_jit",
    "native_tp_compile",
    "keras_dp_jit",
    "native_ddp_compile",
)
# Keras implementation -> the native one it is compared with.
PAIRS = {
    "keras_mp": "native_tp",
    "keras_dp": "native_ddp",
    "keras_local_tp": "native_local_tp",
    "keras_local_dp": "native_local_dp",
    "keras_mp_jit": "native_tp_compile",
    "keras_dp_jit": "native_ddp_compile",
}
# DDP's default bucket size; Keras buckets its gradient all-reduce alike.
DDP_BUCKET_BYTES = 25 * 1024 * 1024
MIB = 1024 * 1024
# Warning the Keras step wrapper gives when torch.compile fails.
EAGER_FALLBACK_TEXT = "Running the step eagerly instead"


@dataclasses.dataclass
class Shapes:
    """Model and batch sizes; `batch` is the global batch.

    `key_dim` is the size of an attention head (default `dim // heads`).
    """

    batch: int
    dim: int
    hidden: int
    seq_len: int
    heads: int
    key_dim: int = None

    def __post_init__(self):
        if self.key_dim is None:
            self.key_dim = self.dim // self.heads


@dataclasses.dataclass
class Runner:
    """One implementation of one model, ready to run training steps.

    Attributes:
        model: "mlp" or "transformer".
        impl: one of `EAGER_IMPLS` / `COMPILED_IMPLS`.
        step: runs one training step; returns the loss (tensor or None).
        activate: makes the runner's Keras distribution current.
        count: returns the collectives of one step (a dict), or None.
        state_bytes: returns this rank's bytes of parameters + optimizer
            state.
        ideal_collectives: the ideal number of collectives per step.
        ideal_bytes: the ideal per-rank bytes of parameters + optimizer
            state.
        loss_fn: turns a step's return value into the global loss (float).
        notes: remarks printed under the table.
    """

    model: str
    impl: str
    step: object
    activate: object
    count: object
    state_bytes: object
    ideal_collectives: int
    ideal_bytes: int
    loss_fn: object
    notes: list = dataclasses.field(default_factory=list)
    times: list = dataclasses.field(default_factory=list)
    cpu_times: list = dataclasses.field(default_factory=list)
    first_loss: float = float("nan")
    collectives: dict = None
    bytes: int = 0

    @property
    def name(self):
        return f"{self.model}/{self.impl}"


# ---------------------------------------------------------------- arguments


def parse_args(argv=None):
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS + ("all",), default="all")
    p.add_argument(
        "--impl",
        nargs="+",
        choices=EAGER_IMPLS + LOCAL_IMPLS + COMPILED_IMPLS,
        help="implementations to run (default: the 4 eager and the 4 local "
        "ones, and the 4 compiled ones with --jit-compile)",
    )
    p.add_argument("--jit-compile", action="store_true",
                   help="also run the compiled steps")
    p.add_argument("--batch", type=int, default=128, help="global batch")
    p.add_argument("--dim", type=int, default=512, help="model width D")
    p.add_argument("--hidden", type=int, default=2048, help="MLP width H")
    p.add_argument("--seq-len", type=int, default=4,
                   help="transformer sequence length")
    p.add_argument("--heads", type=int, default=8,
                   help="transformer attention heads")
    p.add_argument("--steps", type=int, default=5,
                   help="timed steps of each implementation per round")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps of each implementation first")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads per rank")
    p.add_argument("--sdpa", choices=("auto", "math"), default="auto",
                   help="attention kernel of both sides; auto = math on CPU "
                   "(DTensor has no sharding rule for the CPU flash "
                   "attention backward), the default kernels on GPU")
    p.add_argument("--relayout-outputs", action="store_true",
                   help="keras_mp: add LayoutMap keys 'fc2/output' (and "
                   "'attn/output') that make the row-parallel outputs "
                   "replicated, as native RowwiseParallel does")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results here")
    args = p.parse_args(argv)
    if args.impl is None:
        args.impl = list(EAGER_IMPLS) + list(LOCAL_IMPLS)
        if args.jit_compile:
            args.impl += list(COMPILED_IMPLS)
    args.models = list(MODELS) if args.model == "all" else [args.model]
    return args


# ------------------------------------------------------------------ models


def keras_model(kind, shapes):
    """The Keras MLP block or transformer block (pre-LayerNorm)."""
    layers = keras.layers
    D, H = shapes.dim, shapes.hidden
    if kind == "mlp":
        inputs = keras.Input((D,))
        h = layers.Dense(H, activation="relu", name="fc1")(inputs)
        return keras.Model(inputs, layers.Dense(D, name="fc2")(h))
    inputs = keras.Input((shapes.seq_len, D))
    h = layers.LayerNormalization(epsilon=1e-5, name="ln1")(inputs)
    h = layers.MultiHeadAttention(shapes.heads, shapes.key_dim, name="attn")(
        h, h
    )
    x = layers.Add()([inputs, h])
    h = layers.LayerNormalization(epsilon=1e-5, name="ln2")(x)
    h = layers.Dense(H, activation="relu", name="fc1")(h)
    h = layers.Dense(D, name="fc2")(h)
    return keras.Model(inputs, layers.Add()([x, h]))


def keras_tp_layouts(kind, relayout_outputs=False):
    """Megatron layout of the Keras model: LayoutMap key -> axes.

    With `relayout_outputs`, the outputs of the row-parallel layers (left
    `Partial` by DTensor otherwise) are laid out replicated on the "model"
    axis: one all-reduce there, as native `RowwiseParallel` does.
    """
    layouts = {
        "fc1/kernel": (None, "model"),
        "fc1/bias": ("model",),
        "fc2/kernel": ("model", None),
    }
    if kind == "transformer":
        layouts.update({
            "attn/(query|key|value)/kernel": (None, "model", None),
            "attn/(query|key|value)/bias": ("model", None),
            "attn/attention_output/kernel": ("model", None, None),
        })
    if relayout_outputs:
        rank = 2 if kind == "mlp" else 3
        layouts["fc2/output"] = ("batch",) + (None,) * (rank - 1)
        if kind == "transformer":
            layouts["attn/output"] = ("batch", None, None)
    return layouts


class NativeMLP(nn.Module):
    """Dense(H, relu) -> Dense(D), as `nn.Linear`s."""

    def __init__(self, shapes):
        super().__init__()
        self.fc1 = nn.Linear(shapes.dim, shapes.hidden)
        self.fc2 = nn.Linear(shapes.hidden, shapes.dim)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class NativeAttention(nn.Module):
    """Self-attention with a fused QKV projection.

    The QKV rows are ordered (head, q/k/v, head_dim), so a contiguous shard
    of them (`ColwiseParallel`) holds whole heads: each rank then attends
    over its own heads, Megatron's layout.
    """

    def __init__(self, shapes):
        super().__init__()
        self.head_dim = shapes.key_dim
        width = shapes.heads * shapes.key_dim
        self.qkv = nn.Linear(shapes.dim, 3 * width)
        self.out = nn.Linear(width, shapes.dim)

    def forward(self, x):
        b, s, _ = x.shape
        # -1: the local heads under tensor parallelism.
        qkv = self.qkv(x).view(b, s, -1, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, s, -1))


class NativeBlock(nn.Module):
    """The transformer block of `keras_model`, in torch."""

    def __init__(self, shapes):
        super().__init__()
        self.ln1 = nn.LayerNorm(shapes.dim, eps=1e-5)
        self.attn = NativeAttention(shapes)
        self.ln2 = nn.LayerNorm(shapes.dim, eps=1e-5)
        self.fc1 = nn.Linear(shapes.dim, shapes.hidden)
        self.fc2 = nn.Linear(shapes.hidden, shapes.dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.relu(self.fc1(self.ln2(x))))


NATIVE_TP_PLANS = {
    "mlp": {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()},
    "transformer": {
        "attn.qkv": ColwiseParallel(),
        "attn.out": RowwiseParallel(),
        "fc1": ColwiseParallel(),
        "fc2": RowwiseParallel(),
    },
}


def native_state_dict(kind, ref, shapes):
    """Keras weights (path -> global array) as the native module's."""

    def linear(name):
        return {f"{name}.weight": ref[f"{name}/kernel"].T,
                f"{name}.bias": ref[f"{name}/bias"]}

    state = {**linear("fc1"), **linear("fc2")}
    if kind == "mlp":
        return state
    D = shapes.dim
    for ln in ("ln1", "ln2"):
        state[f"{ln}.weight"] = ref[f"{ln}/gamma"]
        state[f"{ln}.bias"] = ref[f"{ln}/beta"]
    qkv = [f"attn/{p}" for p in ("query", "key", "value")]
    # (D, heads, 3, head_dim): whole heads stay contiguous (see above).
    kernel = np.stack([ref[f"{p}/kernel"] for p in qkv], axis=2)
    state["attn.qkv.weight"] = kernel.reshape(D, -1).T
    state["attn.qkv.bias"] = np.stack(
        [ref[f"{p}/bias"] for p in qkv], axis=1
    ).reshape(-1)
    out = ref["attn/attention_output/kernel"]
    state["attn.out.weight"] = out.reshape(-1, D).T
    state["attn.out.bias"] = ref["attn/attention_output/bias"]
    return state


def native_module(kind, ref, shapes, device):
    """The native module of `kind`, with the Keras initial weights."""
    module = NativeMLP(shapes) if kind == "mlp" else NativeBlock(shapes)
    state = {k: torch.from_numpy(np.ascontiguousarray(v))
             for k, v in native_state_dict(kind, ref, shapes).items()}
    module.load_state_dict(state)
    return module.to(device)


# ------------------------------------------------------------ environment


def setup(args):
    """Process group, threads and device; returns the torch device."""
    torch.set_num_threads(args.threads)
    # Joins the torchrun job (gloo on CPU, nccl on GPU).
    keras.distribution.initialize()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def machine_info(args, device):
    """What the numbers were measured on."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads_per_rank": torch.get_num_threads(),
        "torch": torch.__version__,
        "keras": keras.__version__,
        "python": platform.python_version(),
        "world_size": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "device": str(device.type),
        "load_average": _load_average(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _load_average():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def sdpa_context(args, device):
    """The attention-kernel context both sides run their steps in."""
    if args.sdpa == "math" or device.type == "cpu":
        return lambda: sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------- counting helpers


def count_collectives(fn, roots=()):
    """Collectives `fn()` issues, counted by `CommDebugMode`.

    Args:
        fn: runs the work to count.
        roots: modules (Keras models included) `fn` calls.

    Returns:
        {"total", "forward", "backward", "ops": {op name: count}}.
    """
    mode = CommDebugMode()
    try:
        with mode:
            fn()
    finally:
        _remove_tracker_hooks(mode, roots)
    by_pass = mode.comm_module_counts.get("Global", {})
    return {
        "total": mode.get_total_counts(),
        "forward": sum(by_pass.get("forward", {}).values()),
        "backward": sum(by_pass.get("backward", {}).values()),
        "ops": {str(op).split("'")[1] if "'" in str(op) else str(op): n
                for op, n in mode.get_comm_counts().items()},
    }


def _remove_tracker_hooks(mode, roots):
    """Removes forward hooks `CommDebugMode` left on modules.

    Its module tracker keeps one hook handle per module *name*; modules
    that share a name (Keras layers that are not registered children get
    their class name) leave hooks behind that fail on the next call.
    """
    tracker = mode.advanced_module_tracker
    for module in _all_modules(roots):
        for key, hook in list(module._forward_hooks.items()):
            if getattr(hook, "__self__", None) is tracker:
                del module._forward_hooks[key]


def _all_modules(roots):
    seen = {}
    for root in roots:
        modules = list(root.modules())
        if isinstance(root, keras.layers.Layer):
            modules += list(root._flatten_layers(include_self=True,
                                                 recursive=True))
        for m in modules:
            if isinstance(m, nn.Module):
                seen[id(m)] = m
    return seen.values()


def local_bytes(tensors):
    """Bytes this rank holds of `tensors` (local shards of DTensors)."""
    total, seen = 0, set()
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        if isinstance(t, DTensor):
            t = t.to_local()
        total += t.numel() * t.element_size()
    return total


def ideal_state_bytes(ref, layouts, tensor_parallel, world_size):
    """Ideal per-rank bytes of weights + Adam's two moments.

    Sharded weights count 1/N, replicated ones in full; Adam's scalar step
    counters are left out.
    """
    total = 0
    for path, value in ref.items():
        sharded = tensor_parallel and any(
            _fullmatch(key, path) for key in layouts
        )
        total += value.nbytes / world_size if sharded else value.nbytes
    return int(3 * total)


def _fullmatch(pattern, path):
    return re.fullmatch(pattern, path) is not None


def ideal_collectives(kind, impl, ref):
    """Ideal collectives of one training step.

    Megatron tensor parallelism: one all-reduce per block in the forward
    pass (after the row-parallel layer), and one in the backward pass (the
    gradient of the column-parallel layer's input) where that input needs a
    gradient. The MLP's input is data: 1. The transformer's two sub-blocks
    start with a LayerNorm whose weights need the gradient of its output:
    2 forward + 2 backward = 4. Data parallelism: one all-reduce per 25 MiB
    bucket of gradients. A rank training alone: none.
    """
    if "_local_" in impl:
        return 0
    if impl.startswith(("keras_mp", "native_tp")):
        return 1 if kind == "mlp" else 4
    grad_bytes = sum(v.nbytes for v in ref.values())
    return max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES))


# --------------------------------------------------------- Keras runners


def keras_distribution(impl, kind, relayout_outputs):
    """The Keras distribution of a Keras implementation."""
    devices = keras.distribution.list_devices()
    if impl.startswith("keras_dp"):
        return keras.distribution.DataParallel(devices=devices)
    mesh = keras.distribution.DeviceMesh(
        (1, len(devices)), ("batch", "model"), devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in keras_tp_layouts(kind, relayout_outputs).items():
        layout_map[key] = axes
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def keras_runner(kind, impl, shapes, ref, data, ctx, args):
    """A runner driving Keras' own training step (the one `fit` uses)."""
    distribution = None
    if "_local_" not in impl:
        distribution = keras_distribution(impl, kind, args.relayout_outputs)
    keras.distribution.set_distribution(distribution)
    model = keras_model(kind, shapes)
    model.set_weights([ref[v.path] for v in model.weights])
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=1e-3),
        loss="mse",
        jit_compile=impl.endswith("_jit"),
    )
    model.make_train_function()
    train_function = model.train_function
    x, y = data
    batch = [(x, y, None)]

    def step():
        with ctx():
            return train_function(batch)

    def activate():
        keras.distribution.set_distribution(distribution)

    def count():
        with ctx():
            return keras_collectives(model, train_function, batch)

    def state_bytes():
        variables = list(model.weights) + list(model.optimizer.variables)
        return local_bytes([v.value for v in variables])

    tp = impl.startswith("keras_mp")
    return Runner(
        kind, impl, step, activate,
        count=None if impl.endswith("_jit") else count,
        state_bytes=state_bytes,
        ideal_collectives=ideal_collectives(kind, impl, ref),
        ideal_bytes=ideal_state_bytes(
            ref, keras_tp_layouts(kind), tp, dist.get_world_size()
        ),
        loss_fn=lambda logs: float(keras.ops.convert_to_numpy(logs["loss"])),
    )


def keras_collectives(model, train_function, batch):
    """Collectives of a whole Keras step, its gradient reduction, and of
    the optimizer update alone (after the gradients were reduced)."""
    step = count_collectives(lambda: train_function(batch), [model])
    # The step leaves its raw (possibly `Partial`) gradients in `.grad`.
    weights = model.trainable_weights
    grads = [v.value.grad for v in weights]
    reduced = []
    reduction = count_collectives(
        lambda: reduced.extend(distribution_trainer.reduce_gradients(grads))
    )

    def update():
        with torch.no_grad():
            model.optimizer.apply(reduced, weights)

    optimizer = count_collectives(update, [model])
    step["gradient_reduction"] = reduction["total"]
    step["optimizer_alone"] = optimizer["total"]
    # CommDebugMode files what runs after the backward pass (the gradient
    # reduction, the update) under "forward": leave it out there.
    step["forward"] = max(
        0, step["forward"] - reduction["total"] - optimizer["total"]
    )
    return step


# -------------------------------------------------------- native runners


def native_runner(kind, impl, shapes, ref, data, ctx, args, device):
    """A runner of native tensor parallelism or DDP, eager or compiled, or
    of the module alone (`native_local_*`)."""
    world_size = dist.get_world_size()
    module = native_module(kind, ref, shapes, device)
    x, y = data
    tp = impl.startswith("native_tp")
    ddp = impl.startswith("native_ddp")
    if tp:
        mesh = init_device_mesh(device.type, (world_size,),
                                mesh_dim_names=("model",))
        model = parallelize_module(module, mesh, NATIVE_TP_PLANS[kind])
    elif not ddp:
        model = module
    else:
        model = _ddp(module, device)
        # DDP: each rank trains on its part of the global batch.
        rank = dist.get_rank()
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    compiled = impl.endswith("_compile")
    notes = []
    # Static shapes: with automatic dynamic shapes, torch 2.13 fails to
    # trace the DTensor backward of the TP step once it recompiles.
    fn = [torch.compile(train_step, dynamic=False) if compiled
          else train_step]

    def step():
        with ctx():
            if not notes and compiled:
                return _first_compiled_call(fn, train_step, notes)
            return fn[0]()

    def count():
        if not ddp:
            with ctx():
                result = count_collectives(train_step, [model])
                opt = count_collectives(optimizer.step, [model])
            result["optimizer_alone"] = opt["total"]
            return result
        return ddp_collectives(kind, ref, shapes, device, (x, y), ctx)

    def state_bytes():
        state = [t for s in optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor)]
        return local_bytes(list(model.parameters()) + state)

    return Runner(
        kind, impl, step, activate=lambda: None,
        count=None if compiled else count,
        state_bytes=state_bytes,
        ideal_collectives=ideal_collectives(kind, impl, ref),
        ideal_bytes=ideal_state_bytes(
            ref, keras_tp_layouts(kind), tp, world_size
        ),
        loss_fn=_global_mean if ddp else float,
        notes=notes,
    )


def _first_compiled_call(fn, eager_step, notes):
    """Runs the first compiled step; falls back to eager if it fails."""
    try:
        result = fn[0]()
        notes.append("torch.compile(train_step, dynamic=False)")
        return result
    except Exception as e:  # torch.compile raises errors of many types.
        notes.append("torch.compile failed, eager instead: "
                     f"{type(e).__name__}: {' '.join(str(e).split())[:160]}")
        fn[0] = eager_step
        return eager_step()


def _ddp(module, device):
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids,
                                   bucket_cap_mb=DDP_BUCKET_BYTES / MIB)


def _global_mean(loss):
    """Mean of the ranks' losses: the global batch's loss (equal parts)."""
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return float(loss) / dist.get_world_size()


def ddp_collectives(kind, ref, shapes, device, data, ctx):
    """DDP's all-reduces per step, counted with a comm hook.

    `CommDebugMode` cannot see them: DDP's reducer calls the process group
    from C++. A twin DDP module (same model, same bucket size) gets a comm
    hook that counts the buckets it all-reduces (then all-reduces them as
    DDP's default does). DDP rebuilds its buckets after the first step, so
    the third step is counted.
    """
    twin = _ddp(native_module(kind, ref, shapes, device), device)
    calls = []

    def hook(state, bucket):
        calls.append(bucket.buffer().numel())
        return default_hooks.allreduce_hook(state, bucket)

    twin.register_comm_hook(None, hook)
    x, y = data
    with ctx():
        for _ in range(3):
            calls.clear()
            twin.zero_grad(set_to_none=True)
            F.mse_loss(twin(x), y).backward()
    return {
        "total": len(calls),
        "forward": 0,
        "backward": len(calls),
        "ops": {"ddp_bucket_allreduce": len(calls)},
        "bucket_elements": list(calls),
        "optimizer_alone": 0,
    }


# ------------------------------------------------------------ benchmark


def make_data(kind, shapes, seed, device):
    """The global batch (identical on every rank): x and the target y."""
    g = torch.Generator().manual_seed(seed + 1)
    shape = (shapes.batch, shapes.dim)
    if kind == "transformer":
        shape = (shapes.batch, shapes.seq_len, shapes.dim)
    x = torch.rand(shape, generator=g)
    y = torch.rand(shape, generator=g)
    return x.to(device), y.to(device)


def reference_weights(kind, shapes, seed):
    """Initial weights, path -> global array: a Keras build, no distribution.

    Every rank seeds alike, so all ranks build the same values.
    """
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(seed)
    model = keras_model(kind, shapes)
    return {v.path: np.asarray(v.numpy()) for v in model.weights}


def impl_shapes(impl, shapes, world_size):
    """The shapes an implementation trains: the global ones, or one rank's
    share of them for the `*_local_*` floors."""
    if impl.endswith("_local_tp"):
        return dataclasses.replace(
            shapes,
            hidden=shapes.hidden // world_size,
            heads=shapes.heads // world_size,
            key_dim=shapes.key_dim,
        )
    if impl.endswith("_local_dp"):
        return dataclasses.replace(shapes, batch=shapes.batch // world_size)
    return shapes


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
            if impl.startswith("keras"):
                runner = keras_runner(kind, impl, shapes, ref, data, ctx, args)
            else:
                runner = native_runner(
                    kind, impl, shapes, ref, data, ctx, args, device
                )
            runners.append(runner)
    keras.distribution.set_distribution(None)
    return runners


def warm_up(runner, steps):
    """Untimed steps; records the first step's global loss and whether a
    compiled Keras step fell back to eager."""
    runner.activate()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.first_loss = runner.loss_fn(runner.step())
    for w in caught:
        message = " ".join(str(w.message).split())
        if EAGER_FALLBACK_TEXT in message:
            # The reason is in parentheses: "... model (Error: reason). ..."
            reason = message[message.find("(") + 1:message.rfind(")")]
            runner.notes.append("jit_compile fell back to eager: "
                                + reason[:300])
    for _ in range(steps - 1):
        runner.step()


def measure(runners, args, device):
    """Interleaved timing: `rounds` rounds of `steps` steps of each runner,
    in an order rotated every round."""
    for r in range(args.rounds):
        shift = r % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            runner.activate()
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                cpu_start = time.process_time()
                runner.step()
                synchronize(device)
                runner.times.append(time.perf_counter() - start)
                runner.cpu_times.append(time.process_time() - cpu_start)


def slowest_rank_times(runners):
    """Per step, the times of the slowest rank (collective over all ranks).

    Wall time, and CPU time of the process: the CPU time leaves out the
    time a rank was not scheduled or waited for the others, so it is less
    noisy on a busy machine (it does not see GPU work).
    """
    mine = [(r.times, r.cpu_times) for r in runners]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for i, runner in enumerate(runners):
        runner.times = [max(ts) for ts in zip(*(e[i][0] for e in everyone))]
        runner.cpu_times = [
            max(ts) for ts in zip(*(e[i][1] for e in everyone))
        ]


def summarize(runner):
    """JSON-able results of one runner."""
    ms = [t * 1e3 for t in runner.times]
    cpu_ms = [t * 1e3 for t in runner.cpu_times]
    return {
        "model": runner.model,
        "impl": runner.impl,
        "median_ms": statistics.median(ms),
        "min_ms": min(ms),
        "median_cpu_ms": statistics.median(cpu_ms),
        "steps_timed": len(ms),
        "collectives": runner.collectives,
        "ideal_collectives": runner.ideal_collectives,
        "state_bytes": runner.bytes,
        "ideal_state_bytes": runner.ideal_bytes,
        "first_loss": runner.first_loss,
        "notes": runner.notes,
        "times_ms": ms,
        "cpu_times_ms": cpu_ms,
    }


def ratios(results):
    """Keras / native median and min ratios per model and pair."""
    by_name = {(r["model"], r["impl"]): r for r in results}
    out = []
    for (model, impl), r in by_name.items():
        native = by_name.get((model, PAIRS.get(impl)))
        if native is None:
            continue
        out.append({
            "model": model,
            "keras": impl,
            "native": native["impl"],
            "median_ratio": r["median_ms"] / native["median_ms"],
            "min_ratio": r["min_ms"] / native["min_ms"],
            "cpu_ratio": r["median_cpu_ms"] / native["median_cpu_ms"],
            "first_loss_rel_diff": abs(r["first_loss"] - native["first_loss"])
            / max(abs(native["first_loss"]), 1e-12),
        })
    return out


def format_report(info, args, results, pair_ratios):
    """The text rank 0 prints."""
    s = args.shapes
    lines = [
        "Machine: " + ", ".join(f"{k}={v}" for k, v in info.items()),
        f"Shapes: global batch {s.batch}, D {s.dim}, H {s.hidden}, "
        f"transformer seq_len {s.seq_len}, heads {s.heads}; "
        f"{args.rounds} rounds x {args.steps} steps timed, "
        f"{args.warmup} warm-up steps",
        "",
        f"{'model':<12}{'impl':<20}{'median ms':>10}{'min ms':>9}"
        f"{'cpu ms':>9}"
        f"{'colls/step':>11}{'ideal':>6}{'opt-only':>9}"
        f"{'MiB/rank':>10}{'ideal':>8}{'loss@1':>10}",
    ]
    for r in results:
        c = r["collectives"] or {}
        lines.append(
            f"{r['model']:<12}{r['impl']:<20}{r['median_ms']:>10.2f}"
            f"{r['min_ms']:>9.2f}{r['median_cpu_ms']:>9.2f}"
            f"{_fmt(c.get('total')):>11}"
            f"{r['ideal_collectives']:>6}{_fmt(c.get('optimizer_alone')):>9}"
            f"{r['state_bytes'] / MIB:>10.2f}"
            f"{r['ideal_state_bytes'] / MIB:>8.2f}{r['first_loss']:>10.5f}"
        )
    lines += ["", "Keras / native step time:"]
    for p in pair_ratios:
        lines.append(
            f"  {p['model']:<12}{p['keras']:>15} / {p['native']:<16}"
            f"median {p['median_ratio']:.2f}x   min {p['min_ratio']:.2f}x"
            f"   cpu {p['cpu_ratio']:.2f}x"
            f"   (first-step loss rel. diff {p['first_loss_rel_diff']:.1e})"
        )
    if any("_local_" in p["keras"] for p in pair_ratios):
        lines.append(
            "  (*_local_*: each rank alone, no distribution, its share of "
            "the distributed step's work: Keras' own cost over torch)"
        )
    lines += ["", "Collectives per step (CommDebugMode; DDP: comm-hook count):"]
    for r in results:
        c = r["collectives"]
        if c is None:
            lines.append(f"  {r['model']}/{r['impl']}: not counted "
                         "(compiled step)")
            continue
        extra = ""
        if "gradient_reduction" in c:
            extra = f", gradient reduction {c['gradient_reduction']}"
        lines.append(
            f"  {r['model']}/{r['impl']}: forward+loss {c['forward']}, "
            f"backward {c['backward']}{extra}, optimizer alone "
            f"{c['optimizer_alone']}; {c['ops']}"
        )
    notes = [f"  {r['model']}/{r['impl']}: {n}" for r in results
             for n in r["notes"]]
    if notes:
        lines += ["", "Notes:"] + notes
    return "\n".join(lines)


def _fmt(value):
    return "-" if value is None else str(value)


def check_shapes(shapes, models, world_size):
    """Raises ValueError for shapes the N-way splits cannot take evenly."""
    problems = []
    if shapes.batch % world_size:
        problems.append(f"--batch {shapes.batch} (DDP: equal parts)")
    if shapes.hidden % world_size:
        problems.append(f"--hidden {shapes.hidden}")
    if "transformer" in models and (
        shapes.heads % world_size or shapes.dim % shapes.heads
    ):
        problems.append(f"--heads {shapes.heads} (a multiple of the "
                        f"{world_size} ranks dividing --dim {shapes.dim})")
    if problems:
        raise ValueError(f"Not divisible by the {world_size} ranks: "
                         + ", ".join(problems))


def main(argv=None):
    args = parse_args(argv)
    args.shapes = Shapes(args.batch, args.dim, args.hidden, args.seq_len,
                         args.heads)
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
        sys.stdout.write(format_report(info, args, results, pair_ratios)
                         + "\n")
        sys.stdout.flush()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": info,
                           "args": {k: v for k, v in vars(args).items()
                                    if k != "shapes"},
                           "shapes": dataclasses.asdict(args.shapes),
                           "results": results, "ratios": pair_ratios},
                          f, indent=1)
    dist.barrier()
    # Torn down here, not at interpreter exit: the DDP reducers and gloo's
    # threads still alive then can abort a rank ("terminate called without
    # an active exception").
    del runners
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
