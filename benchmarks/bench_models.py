"""The benchmarked models, their shapes, initial weights and data.

Both sides train the same models: an MLP block and a pre-LayerNorm
transformer block, built once in Keras (`keras_model`) and once as an
`nn.Module` (`native_module`) that gets the Keras build's initial weights.
`keras_tp_layouts` is their Megatron layout on the Keras side.
"""

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import keras


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
        problems.append(
            f"--heads {shapes.heads} (a multiple of the "
            f"{world_size} ranks dividing --dim {shapes.dim})"
        )
    if problems:
        raise ValueError(
            f"Not divisible by the {world_size} ranks: " + ", ".join(problems)
        )


# ------------------------------------------------------------------ Keras


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
        layouts.update(
            {
                "attn/(query|key|value)/kernel": (None, "model", None),
                "attn/(query|key|value)/bias": ("model", None),
                "attn/attention_output/kernel": ("model", None, None),
            }
        )
    if relayout_outputs:
        rank = 2 if kind == "mlp" else 3
        layouts["fc2/output"] = ("batch",) + (None,) * (rank - 1)
        if kind == "transformer":
            layouts["attn/output"] = ("batch", None, None)
    return layouts


def reference_weights(kind, shapes, seed):
    """Initial weights, path -> global array: a Keras build, no distribution.

    Every rank seeds alike, so all ranks build the same values.
    """
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(seed)
    model = keras_model(kind, shapes)
    return {v.path: np.asarray(v.numpy()) for v in model.weights}


def make_data(kind, shapes, seed, device):
    """The global batch (identical on every rank): x and the target y."""
    g = torch.Generator().manual_seed(seed + 1)
    shape = (shapes.batch, shapes.dim)
    if kind == "transformer":
        shape = (shapes.batch, shapes.seq_len, shapes.dim)
    x = torch.rand(shape, generator=g)
    y = torch.rand(shape, generator=g)
    return x.to(device), y.to(device)


# ------------------------------------------------------------------ torch


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


def native_state_dict(kind, ref, shapes):
    """Keras weights (path -> global array) as the native module's."""

    def linear(name):
        return {
            f"{name}.weight": ref[f"{name}/kernel"].T,
            f"{name}.bias": ref[f"{name}/bias"],
        }

    state = {**linear("fc1"), **linear("fc2")}
    if kind == "mlp":
        return state
    D = shapes.dim
    for ln in ("ln1", "ln2"):
        state[f"{ln}.weight"] = ref[f"{ln}/gamma"]
        state[f"{ln}.bias"] = ref[f"{ln}/beta"]
    qkv = [f"attn/{p}" for p in ("query", "key", "value")]
    # (D, heads, 3, head_dim): whole heads stay contiguous (see
    # NativeAttention).
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
    state = {
        k: torch.from_numpy(np.ascontiguousarray(v))
        for k, v in native_state_dict(kind, ref, shapes).items()
    }
    module.load_state_dict(state)
    return module.to(device)
