"""Fine-tunes a tiny keras-hub causal LM with `AutoModelParallel`.

No layout map: `keras.distribution.AutoModelParallel()` puts every process
on the `model` axis of a `(1, N)` mesh (or, with `--batch-parallel B`, a
`(B, N / B)` mesh) and plans the tensor parallelism from the model itself,
as its variables are created. Any keras-hub causal LM works alike; this
script builds a tiny one from a config (no download): Qwen by default,
whose backbone ships no layout map of its own, or another with
`--model`.

    ./run_multi_gpu.sh examples/finetune_auto_parallel.py
    ./run_multi_gpu.sh -n 4 examples/finetune_auto_parallel.py --model gpt2
    KERAS_BACKEND=torch python examples/finetune_auto_parallel.py  # 1 process

Rank 0 prints the sharding summary (each variable's layout and what in the
plan decided it), the progress bars, the generated tokens and one
`RESULT {...}` line; one process reaches the same losses and tokens.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

from finetune_keras_hub import VOCAB_SIZE  # noqa: E402
from finetune_keras_hub import fine_tune_and_generate  # noqa: E402

import keras  # noqa: E402

# keras-hub backbone and causal LM class names, by `--model`.
MODELS = {
    "qwen3": "Qwen3",
    "mistral": "Mistral",
    "gpt2": "GPT2",
    "phi3": "Phi3",
    "gemma": "Gemma",
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    parser.add_argument(
        "--batch-parallel",
        type=int,
        default=1,
        help="processes on the `batch` mesh axis (the rest on `model`)",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--samples", type=int, default=64)
    return parser.parse_args()


def build_causal_lm(name):
    """A tiny causal LM of keras-hub class `name` (2 layers, width 32)."""
    import keras_hub

    prefix = MODELS[name]
    config = dict(
        vocabulary_size=VOCAB_SIZE,
        num_layers=2,
        hidden_dim=32,
        intermediate_dim=64,
    )
    if prefix == "GPT2":
        config.update(num_heads=4, max_sequence_length=32)
    else:
        config.update(num_query_heads=4, num_key_value_heads=2)
    if prefix == "Gemma":
        config["head_dim"] = 8
    if prefix == "Qwen3":
        config["head_dim"] = 8
    backbone = getattr(keras_hub.models, prefix + "Backbone")(**config)
    causal_lm_class = getattr(keras_hub.models, prefix + "CausalLM")
    return causal_lm_class(backbone=backbone, preprocessor=None)


def make_distribution(batch_parallel):
    """`AutoModelParallel` on a (batch_parallel, N / batch_parallel) mesh."""
    devices = keras.distribution.list_devices()
    if len(devices) % batch_parallel:
        raise ValueError(
            f"--batch-parallel {batch_parallel} does not divide the number "
            f"of processes ({len(devices)})"
        )
    if batch_parallel == 1:
        return keras.distribution.AutoModelParallel()
    mesh = keras.distribution.DeviceMesh(
        (batch_parallel, len(devices) // batch_parallel),
        ("batch", "model"),
        devices,
    )
    return keras.distribution.AutoModelParallel(device_mesh=mesh)


def main():
    args = parse_args()
    keras.distribution.initialize()
    distribution = None
    if len(keras.distribution.list_devices()) > 1:
        distribution = make_distribution(args.batch_parallel)
        # Every variable created from now on is laid out by the plan.
        keras.distribution.set_distribution(distribution)
    fine_tune_and_generate(
        lambda: build_causal_lm(args.model), distribution, args
    )


if __name__ == "__main__":
    main()
