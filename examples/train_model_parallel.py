"""Trains a small transformer language model with model parallelism.

The processes form a 2D device mesh `(batch, model)`. Along the `model` axis
the attention and MLP weights are split Megatron-style (a `LayoutMap` maps
variable paths to layouts); along the `batch` axis every batch is split, as
in data parallelism.

    - query / key / value kernels: split on the heads dimension (each process
      computes its own attention heads);
    - attention output kernel: split on the heads dimension too (row
      parallel: the partial outputs are summed across the `model` axis);
    - first MLP Dense: kernel split on its output units (column parallel);
    - second MLP Dense: kernel split on its input units (row parallel);
    - embeddings: split on the feature dimension.

Launch it on every GPU (or on 2 CPU processes with gloo when there is none):

    ./run_multi_gpu.sh examples/train_model_parallel.py

or with torchrun directly, e.g. on a 2 x 2 mesh (2 data-parallel groups of
2 model-parallel processes):

    torchrun --nproc_per_node=4 examples/train_model_parallel.py \
        --model-parallel 2

By default all processes are on the `model` axis. Rank 0 prints the sharding
summary (which layout each variable got, and what this process stores), the
Keras progress bars, and one machine-readable line at the end:

    RESULT {"loss": 1.23, "epoch_losses": [...], "mesh_shape": [1, 2], ...}
"""

import argparse
import json
import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402

import keras  # noqa: E402

SEED = 1337
VOCAB_SIZE = 32
MAX_STRIDE = 4


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-parallel",
        type=int,
        default=None,
        help="processes on the `model` mesh axis (default: all of them)",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--batch-size", type=int, default=32, help="global batch size"
    )
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--sequence-length", type=int, default=16)
    parser.add_argument("--embed-dim", type=int, default=32)
    parser.add_argument(
        "--num-heads",
        type=int,
        default=4,
        help="attention heads; a multiple of --model-parallel",
    )
    parser.add_argument("--num-blocks", type=int, default=2)
    parser.add_argument(
        "--output",
        # The same path on every process: all of them call `model.save`.
        default=os.path.join(tempfile.gettempdir(), "model_parallel.keras"),
        help="where to save the trained model (.keras)",
    )
    parser.add_argument(
        "--summary-all-ranks",
        action="store_true",
        help="print the sharding summary on every process, not only rank 0",
    )
    return parser.parse_args()


# --------------------------------------------------------------------------
# Data: counting sequences
# --------------------------------------------------------------------------


def make_dataset(num_samples, sequence_length):
    """Returns (inputs, next-token targets) of a learnable synthetic task.

    Each sequence counts modulo `VOCAB_SIZE` from a random start with a
    random stride: `start, start + s, start + 2s, ...`. The first token says
    nothing about the stride, but from the second one on the next token is
    determined by the context, so a model with attention can learn it.
    Every process generates the same arrays (fixed seed).
    """
    rng = np.random.default_rng(SEED)
    starts = rng.integers(0, VOCAB_SIZE, size=(num_samples, 1))
    strides = rng.integers(1, MAX_STRIDE + 1, size=(num_samples, 1))
    steps = np.arange(sequence_length + 1)[None, :]
    tokens = ((starts + strides * steps) % VOCAB_SIZE).astype("int32")
    return tokens[:, :-1], tokens[:, 1:]


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------


@keras.saving.register_keras_serializable(package="train_model_parallel")
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Sum of a token embedding and a learned position embedding."""

    def __init__(self, sequence_length, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.sequence_length = sequence_length
        self.vocab_size = vocab_size
        self.embed_dim = embed_dim
        self.token_embedding = keras.layers.Embedding(
            vocab_size, embed_dim, name="token_embedding"
        )
        self.position_embedding = keras.layers.Embedding(
            sequence_length, embed_dim, name="position_embedding"
        )

    def build(self, input_shape):
        self.token_embedding.build(input_shape)
        self.position_embedding.build((self.sequence_length,))

    def call(self, tokens):
        positions = keras.ops.arange(keras.ops.shape(tokens)[-1])
        return self.token_embedding(tokens) + self.position_embedding(positions)

    def get_config(self):
        return {
            **super().get_config(),
            "sequence_length": self.sequence_length,
            "vocab_size": self.vocab_size,
            "embed_dim": self.embed_dim,
        }


@keras.saving.register_keras_serializable(package="train_model_parallel")
class TransformerBlock(keras.layers.Layer):
    """Causal self-attention and an MLP, each with a residual and a norm."""

    def __init__(self, embed_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.attention = keras.layers.MultiHeadAttention(
            num_heads, key_dim=embed_dim // num_heads, name="attention"
        )
        self.attention_norm = keras.layers.LayerNormalization(
            name="attention_norm"
        )
        self.mlp_up = keras.layers.Dense(
            4 * embed_dim, activation="relu", name="mlp_up"
        )
        self.mlp_down = keras.layers.Dense(embed_dim, name="mlp_down")
        self.mlp_norm = keras.layers.LayerNormalization(name="mlp_norm")

    def build(self, input_shape):
        self.attention.build(input_shape, input_shape)
        self.attention_norm.build(input_shape)
        self.mlp_up.build(input_shape)
        self.mlp_down.build((*input_shape[:-1], 4 * self.embed_dim))
        self.mlp_norm.build(input_shape)

    def call(self, x):
        attended = self.attention(x, x, use_causal_mask=True)
        x = self.attention_norm(x + attended)
        return self.mlp_norm(x + self.mlp_down(self.mlp_up(x)))

    def get_config(self):
        return {
            **super().get_config(),
            "embed_dim": self.embed_dim,
            "num_heads": self.num_heads,
        }


def build_model(sequence_length, embed_dim, num_heads, num_blocks):
    tokens = keras.Input(shape=(sequence_length,), dtype="int32")
    x = TokenAndPositionEmbedding(
        sequence_length, VOCAB_SIZE, embed_dim, name="embedding"
    )(tokens)
    for i in range(num_blocks):
        x = TransformerBlock(embed_dim, num_heads, name=f"block_{i}")(x)
    logits = keras.layers.Dense(VOCAB_SIZE, name="logits")(x)
    return keras.Model(tokens, logits, name="tiny_lm")


# --------------------------------------------------------------------------
# Distribution
# --------------------------------------------------------------------------


def make_layout_map(device_mesh):
    """Megatron-style layouts; the keys are regexes of variable paths.

    The paths look like `block_0/attention/query/kernel` (print
    `[v.path for v in model.weights]` to see them). Variables matched by no
    key (layer norms, biases of row-parallel layers, the output layer) are
    replicated.
    """
    layout_map = keras.distribution.LayoutMap(device_mesh)
    # Embeddings: (vocab or positions, embed_dim), split on the features.
    layout_map[".*_embedding/embeddings"] = (None, "model")
    # Query / key / value kernels: (embed_dim, heads, head_dim) and biases
    # (heads, head_dim), split on the heads: column parallel.
    layout_map[".*attention/(query|key|value)/kernel"] = (None, "model", None)
    layout_map[".*attention/(query|key|value)/bias"] = ("model", None)
    # Attention output kernel: (heads, head_dim, embed_dim), split on the
    # heads: row parallel.
    layout_map[".*attention/attention_output/kernel"] = ("model", None, None)
    # MLP: (embed_dim, 4 * embed_dim) column parallel, then
    # (4 * embed_dim, embed_dim) row parallel.
    layout_map[".*mlp_up/kernel"] = (None, "model")
    layout_map[".*mlp_up/bias"] = ("model",)
    layout_map[".*mlp_down/kernel"] = ("model", None)
    return layout_map


def make_distribution(model_parallel):
    """Returns a `ModelParallel` distribution on a (batch, model) mesh.

    Args:
        model_parallel: processes on the `model` axis, or `None` for all.
    """
    devices = keras.distribution.list_devices()
    model_parallel = model_parallel or len(devices)
    if len(devices) % model_parallel:
        raise ValueError(
            f"--model-parallel {model_parallel} does not divide the number "
            f"of processes ({len(devices)})"
        )
    device_mesh = keras.distribution.DeviceMesh(
        shape=(len(devices) // model_parallel, model_parallel),
        axis_names=("batch", "model"),
        devices=devices,
    )
    return keras.distribution.ModelParallel(
        layout_map=make_layout_map(device_mesh), batch_dim_name="batch"
    )


def check_splittable(args, model_parallel):
    """Each process of the `model` axis must get whole heads and features."""
    sizes = {"--num-heads": args.num_heads, "--embed-dim": args.embed_dim}
    for flag, size in sizes.items():
        if size % model_parallel:
            raise ValueError(
                f"{flag} {size} cannot be split over {model_parallel} "
                "processes on the `model` axis: use a multiple of "
                f"{model_parallel}, or a smaller --model-parallel"
            )


def main():
    args = parse_args()

    keras.distribution.initialize()
    distribution = make_distribution(args.model_parallel)
    check_splittable(args, model_parallel=distribution.device_mesh.shape[1])
    # Variables created from now on get their layouts from the LayoutMap.
    keras.distribution.set_distribution(distribution)
    is_chief = keras.distribution.mesh_info()["process_id"] == 0

    keras.utils.set_random_seed(SEED)
    inputs, targets = make_dataset(args.samples, args.sequence_length)
    model = build_model(
        args.sequence_length, args.embed_dim, args.num_heads, args.num_blocks
    )
    if is_chief or args.summary_all_ranks:
        # Reads only this process' metadata: no need to call it everywhere.
        keras.distribution.sharding_summary(model, print_fn=print)

    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(
        inputs,
        targets,
        batch_size=args.batch_size,
        epochs=args.epochs,
        # A fixed batch order makes runs on different meshes comparable.
        shuffle=False,
        verbose=1,  # A progress bar, printed by process 0 only.
    )
    loss, accuracy = model.evaluate(
        inputs, targets, batch_size=args.batch_size, verbose=0
    )

    # Every process calls save(); process 0 writes the file.
    model.save(args.output)

    if is_chief:
        print(f"final loss {loss:.4f}, next-token accuracy {accuracy:.4f}")
        print(f"model saved to {args.output}")
        result = {
            "loss": loss,
            "accuracy": accuracy,
            "epoch_losses": history.history["loss"],
            "world_size": distribution.device_mesh.devices.size,
            "mesh_shape": list(distribution.device_mesh.shape),
            "output": args.output,
        }
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
