"""Fine-tunes a tiny keras-hub causal LM on a 2D mesh, then generates.

The processes form a `(batch, model)` device mesh and the backbone's own
`get_layout_map` says how its weights are sharded (for Gemma and Llama,
kernels over both axes, FSDP-like). Training goes through keras-hub's own
`CausalLM.fit` on numpy arrays; `generate()` then completes a batch of
prompts greedily, and every process gets the same tokens.

The model is built from a tiny config, so the script needs no download. A
real fine-tuning run builds the model from a preset inside the same
distribution, e.g. `keras_hub.models.GemmaCausalLM.from_preset(...)`.

Launch it on every GPU (or on 2 CPU processes with gloo when there is none):

    ./run_multi_gpu.sh examples/finetune_keras_hub.py

on a 2 x 2 mesh:

    ./run_multi_gpu.sh -n 4 examples/finetune_keras_hub.py

or as one plain process, without a distribution (the same losses and
tokens):

    KERAS_BACKEND=torch python examples/finetune_keras_hub.py

By default the `model` axis has 2 processes when their number is even (a
(1, 2) mesh on 2 processes, (2, 2) on 4), else 1. Rank 0 prints the
sharding summary, the progress bars, the generated tokens and one
machine-readable line at the end:

    RESULT {"epoch_losses": [...], "generated": [[...], ...], ...}
"""

import argparse
import json
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402

import keras  # noqa: E402

SEED = 1337
VOCAB_SIZE = 32
SEQUENCE_LENGTH = 12
PROMPT_LENGTH = 4


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gemma", "llama"), default="gemma")
    parser.add_argument(
        "--model-parallel",
        type=int,
        default=None,
        help="processes on the `model` mesh axis (default: 2 if even, else 1)",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--batch-size", type=int, default=8, help="global batch size"
    )
    parser.add_argument("--samples", type=int, default=64)
    return parser.parse_args()


def make_dataset(num_samples):
    """Counting sequences modulo `VOCAB_SIZE`, for next-token prediction.

    Returns `(x, y, sample_weight)` as keras-hub's `CausalLM.fit` takes
    them without a preprocessor: `x` holds `token_ids` and `padding_mask`.
    Every process generates the same arrays (fixed seed).
    """
    rng = np.random.default_rng(SEED)
    starts = rng.integers(1, VOCAB_SIZE, size=(num_samples, 1))
    strides = rng.integers(1, 4, size=(num_samples, 1))
    steps = np.arange(SEQUENCE_LENGTH + 1)[None, :]
    tokens = ((starts + strides * steps) % VOCAB_SIZE).astype("int32")
    mask = np.ones((num_samples, SEQUENCE_LENGTH), dtype=bool)
    x = {"token_ids": tokens[:, :-1], "padding_mask": mask}
    return x, tokens[:, 1:], mask.astype("float32")


def make_prompts(x):
    """The first `PROMPT_LENGTH` tokens of 4 sequences, padded."""
    mask = np.zeros((4, SEQUENCE_LENGTH), dtype=bool)
    mask[:, :PROMPT_LENGTH] = True
    token_ids = np.where(mask, x["token_ids"][:4], 0).astype("int32")
    return {"token_ids": token_ids, "padding_mask": mask}


def make_distribution(backbone_class, model_parallel):
    """A `ModelParallel` on a (batch, model) mesh, with the model's layouts.

    Args:
        backbone_class: the keras-hub backbone class (its `get_layout_map`).
        model_parallel: processes on the `model` axis, or `None`.
    """
    devices = keras.distribution.list_devices()
    if model_parallel is None:
        model_parallel = 2 if len(devices) % 2 == 0 else 1
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
    layout_map = backbone_class.get_layout_map(
        device_mesh, model_parallel_dim_name="model"
    )
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def build_causal_lm(name):
    """A tiny Gemma (one key/value head) or Llama causal LM."""
    import keras_hub

    config = dict(
        vocabulary_size=VOCAB_SIZE,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=1,
        hidden_dim=32,
        intermediate_dim=64,
    )
    if name == "gemma":
        backbone = keras_hub.models.GemmaBackbone(head_dim=8, **config)
        return keras_hub.models.GemmaCausalLM(backbone=backbone)
    backbone = keras_hub.models.LlamaBackbone(**config)
    return keras_hub.models.LlamaCausalLM(backbone=backbone)


def backbone_class(name):
    import keras_hub

    return {
        "gemma": keras_hub.models.GemmaBackbone,
        "llama": keras_hub.models.LlamaBackbone,
    }[name]


def main():
    args = parse_args()

    keras.distribution.initialize()
    distribution = None
    if len(keras.distribution.list_devices()) > 1:
        distribution = make_distribution(
            backbone_class(args.model), args.model_parallel
        )
        # Variables created from now on get their layouts from the LayoutMap.
        keras.distribution.set_distribution(distribution)
    fine_tune_and_generate(
        lambda: build_causal_lm(args.model), distribution, args
    )


def fine_tune_and_generate(build, distribution, args):
    """Builds a causal LM under `distribution`, fits it, generates.

    Args:
        build: returns the keras-hub causal LM (called after seeding).
        distribution: the distribution set, or `None` (one process).
        args: `epochs`, `batch_size` and `samples` from the command line.
    """
    is_chief = (
        distribution is None
        or keras.distribution.mesh_info()["process_id"] == 0
    )

    keras.utils.set_random_seed(SEED)
    causal_lm = build()
    if distribution and is_chief:
        keras.distribution.sharding_summary(causal_lm, print_fn=print)
    causal_lm.compile(
        optimizer=keras.optimizers.Adam(learning_rate=3e-3),
        sampler="greedy",
    )
    x, y, sample_weight = make_dataset(args.samples)
    history = causal_lm.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=args.batch_size,
        epochs=args.epochs,
        # A fixed batch order makes runs on different meshes comparable.
        shuffle=False,
        verbose=1 if is_chief else 0,
    )
    # Without a preprocessor, generation runs until the prompts are full.
    generated = causal_lm.generate(make_prompts(x), stop_token_ids=None)
    tokens = np.asarray(generated["token_ids"]).tolist()

    if is_chief:
        for row in tokens:
            print("generated:", row)
        result = {
            "epoch_losses": history.history["loss"],
            "generated": tokens,
            "mesh_shape": (
                list(distribution.device_mesh.shape) if distribution else None
            ),
        }
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
