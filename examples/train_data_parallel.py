"""Trains a small classifier with data parallelism on every process.

Each process holds a full copy of the model and works on its own slice of
every batch; gradients are summed across processes once per step, so the
result is the same as training on one process with the same global batch.

Launch it on every GPU (or on 2 CPU processes with gloo when there is none):

    ./run_multi_gpu.sh examples/train_data_parallel.py --epochs 5

or with torchrun directly:

    torchrun --nproc_per_node=2 examples/train_data_parallel.py

It also runs as one plain process: `python examples/train_data_parallel.py`.

`--batch-size` is the GLOBAL batch size: with 4 processes and
`--batch-size 256`, each process computes on 64 rows per step.

Rank 0 prints the Keras progress bars, the final metrics, and one
machine-readable line at the end:

    RESULT {"loss": 0.41, "accuracy": 0.88, "epoch_losses": [...], ...}
"""

import argparse
import json
import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402

import keras  # noqa: E402

NUM_FEATURES = 32
NUM_CLASSES = 10
SEED = 1337


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument(
        "--batch-size", type=int, default=128, help="global batch size"
    )
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument(
        "--output",
        # The same path on every process: all of them call `model.save`.
        default=os.path.join(tempfile.gettempdir(), "data_parallel.keras"),
        help="where to save the trained model (.keras)",
    )
    parser.add_argument(
        "--jit-compile",
        action="store_true",
        help="compile the steps with torch.compile (they run eagerly, "
        "with a warning, where it fails)",
    )
    return parser.parse_args()


def make_dataset(num_samples):
    """Returns deterministic features and labels of a learnable task.

    Every process generates the same arrays (fixed seed) and passes the full
    dataset to `fit`: each step then keeps its own rows of the global batch.
    """
    rng = np.random.default_rng(SEED)
    features = rng.normal(size=(num_samples, NUM_FEATURES)).astype("float32")
    # Labels come from a fixed random linear map: a task the model can learn.
    projection = rng.normal(size=(NUM_FEATURES, NUM_CLASSES))
    labels = np.argmax(features @ projection, axis=-1).astype("int32")
    return features, labels


def build_model():
    inputs = keras.Input(shape=(NUM_FEATURES,))
    x = keras.layers.Dense(64, activation="relu")(inputs)
    x = keras.layers.Dense(64, activation="relu")(x)
    outputs = keras.layers.Dense(NUM_CLASSES, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="classifier")


def main():
    args = parse_args()

    # Joins the process group torchrun describes (RANK, WORLD_SIZE, ...);
    # as a plain process it simply runs on its own.
    keras.distribution.initialize()
    # One device per process (all GPUs, or CPU processes): a 1D mesh.
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    mesh_info = keras.distribution.mesh_info()
    is_chief = mesh_info["process_id"] == 0

    # The same seed on every process: the weights start identical everywhere.
    keras.utils.set_random_seed(SEED)
    features, labels = make_dataset(args.samples)
    model = build_model()
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=5e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        jit_compile=args.jit_compile,
    )

    history = model.fit(
        features,
        labels,
        batch_size=args.batch_size,
        epochs=args.epochs,
        # A fixed batch order, for reproducibility: runs on 1, 2 or N
        # processes then see the same global batches and reach the same loss,
        # which makes a quick check of a multi-process setup.
        shuffle=False,
        verbose=2,  # Progress is printed by process 0 only.
    )
    loss, accuracy = model.evaluate(
        features, labels, batch_size=args.batch_size, verbose=0
    )

    # Every process calls save(); process 0 writes the file.
    model.save(args.output)

    if is_chief:
        print(f"final loss {loss:.4f}, accuracy {accuracy:.4f}")
        print(f"model saved to {args.output}")
        result = {
            "loss": loss,
            "accuracy": accuracy,
            "epoch_losses": history.history["loss"],
            "world_size": mesh_info["num_processes"],
            "output": args.output,
        }
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
