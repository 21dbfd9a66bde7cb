"""The share of a model one process stores under `AutoModelParallel`.

keras-hub backbones at a preset's widths (one or two layers, a small
vocabulary: no download, no training, nothing allocated but the weights of
one process' build), planned in one process for (1, 2), (1, 4) and (2, 2)
meshes (`tests/auto_plan_recorder.py`): the fraction of the parameters one
process would store, against the acceptance bound 1/N + 0.05. The tiny
configs of the keras-hub catalogue exaggerate what stays replicated (norm
scales and biases are a larger part of a width-16 model)::

    KERAS_BACKEND=torch python benchmarks/bench_auto_plan_share.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import hub_catalogue as hc  # noqa: E402
from tests.auto_plan_recorder import record_plan  # noqa: E402

MESHES = (
    {"batch": 1, "model": 2},
    {"batch": 1, "model": 4},
    {"batch": 2, "model": 2},
)
# Preset-like widths (heads, intermediate and LoRA sizes of released
# checkpoints), few layers.
CONFIGS = {
    "Gemma": dict(
        hc.CONFIGS["Gemma"],
        vocabulary_size=1024,
        hidden_dim=2048,
        intermediate_dim=32768,
        num_query_heads=8,
        num_key_value_heads=1,
        head_dim=256,
    ),
    "SmolLM": dict(
        hc.CONFIGS["SmolLM"],
        vocabulary_size=1024,
        hidden_dim=2048,
        intermediate_dim=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "RWKV7": dict(
        vocabulary_size=1024,
        num_layers=1,
        hidden_size=2048,
        head_size=64,
        intermediate_dim=8192,
        gate_lora=256,
        mv_lora=64,
        aaa_lora=64,
        decay_lora=96,
    ),
}


def main():
    for name, config in CONFIGS.items():
        for mesh in MESHES:
            built = {}

            def build():
                built["backbone"] = hc.backbone_class(name)(**config)

            recorder = record_plan(build, mesh)
            share = recorder.share(built["backbone"].weights)
            processes = mesh["batch"] * mesh["model"]
            print(
                f"{name} mesh ({mesh['batch']}, {mesh['model']}): one process "
                f"stores {share:.4f} of the parameters (bound "
                f"{1 / processes + 0.05:.3f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
