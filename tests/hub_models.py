"""Tiny keras-hub causal LMs for the keras-hub tests (no downloaded weights).

Shared by `tests/test_keras_hub.py` (the pytest process computes the
single-process references) and its multi-rank bodies. The same `kind`
gives the same data, initial weights and training on one process as on
several.

Kinds:
    "gemma": `GemmaCausalLM`, 1 key/value head: sharded over a model axis
        of 2 it is uneven.
    "llama": `LlamaCausalLM`; its layout map shards kernels over both the
        batch and the model axis.
"""

import numpy as np

SEED = 7
VOCAB = 32
SEQ_LEN = 6
NUM_SAMPLES = 8
BATCH = 4
# Prompts for `generate`: the first `PROMPT_LEN` tokens, the rest padding.
PROMPT_LEN = 4
NUM_PROMPTS = 3


def backbone_class(kind):
    import keras_hub

    return {
        "gemma": keras_hub.models.GemmaBackbone,
        "llama": keras_hub.models.LlamaBackbone,
    }[kind]


def use_model_parallel(kind, mesh_shape):
    """Sets a `ModelParallel` with the backbone's own `get_layout_map`.

    Args:
        kind: "gemma" or "llama".
        mesh_shape: shape of the ("batch", "model") device mesh, or `None`
            for no distribution.

    Returns:
        The `LayoutMap`, or `None`.
    """
    from keras import distribution as kd

    if mesh_shape is None:
        kd.set_distribution(None)
        return None
    mesh = kd.DeviceMesh(
        mesh_shape, axis_names=("batch", "model"), devices=kd.list_devices()
    )
    layout_map = backbone_class(kind).get_layout_map(mesh)
    kd.set_distribution(
        kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    return layout_map


def build_causal_lm(kind):
    """A tiny causal LM of `kind`, without preprocessor, compiled greedy."""
    import keras_hub

    import keras

    keras.utils.set_random_seed(SEED)
    common = dict(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1 if kind == "gemma" else 2,
        hidden_dim=16,
        intermediate_dim=32,
    )
    if kind == "gemma":
        backbone = keras_hub.models.GemmaBackbone(head_dim=8, **common)
        lm = keras_hub.models.GemmaCausalLM(backbone=backbone)
    else:
        backbone = keras_hub.models.LlamaBackbone(**common)
        lm = keras_hub.models.LlamaCausalLM(backbone=backbone)
    lm.compile(
        optimizer=keras.optimizers.Adam(learning_rate=0.01),
        sampler="greedy",
    )
    return lm


def make_data(num_samples=NUM_SAMPLES, seed=0):
    """`(x, y, sample_weight)` numpy arrays: next-token prediction."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=(num_samples, SEQ_LEN + 1))
    lengths = rng.integers(SEQ_LEN // 2, SEQ_LEN + 1, size=num_samples)
    mask = np.arange(SEQ_LEN)[None, :] < lengths[:, None]
    x = {
        "token_ids": np.where(mask, tokens[:, :-1], 0).astype("int32"),
        "padding_mask": mask,
    }
    y = np.where(mask, tokens[:, 1:], 0).astype("int32")
    return x, y, mask.astype("float32")


def prompts():
    """A batch of prompts of `PROMPT_LEN` tokens, padded to `SEQ_LEN`."""
    x, _, _ = make_data(NUM_PROMPTS, seed=3)
    mask = np.arange(SEQ_LEN)[None, :] < PROMPT_LEN
    mask = np.broadcast_to(mask, (NUM_PROMPTS, SEQ_LEN))
    return {
        "token_ids": np.where(mask, x["token_ids"], 0).astype("int32"),
        "padding_mask": mask.copy(),
    }


def placements(model):
    """`{path: placements as text}` of the model's weights."""
    return {
        v.path: str(tuple(getattr(v.value, "placements", ())))
        for v in model.weights
    }


def expected_placements(model, layout_map):
    """`{path: placements as text}` that `layout_map` asks for.

    A variable that no rule matches is replicated.
    """
    mesh_axes = layout_map.device_mesh.axis_names
    expected = {}
    for v in model.weights:
        layout = layout_map[v.path]
        axes = tuple(layout.axes) if layout is not None else ()
        placements = [
            f"Shard(dim={axes.index(name)})" if name in axes else "Replicate()"
            for name in mesh_axes
        ]
        expected[v.path] = "(" + ", ".join(placements) + ")"
    return expected


def train_and_generate(kind, mesh_shape, *, epochs=1):
    """Fits `kind` with keras-hub's `fit` on numpy, then generates.

    Returns:
        A dict: `history`, the final `weights` (global values by path),
        the generated `tokens`, the weights' `placements` and those that
        `get_layout_map` asks for (`expected_placements`).
    """
    layout_map = use_model_parallel(kind, mesh_shape)
    lm = build_causal_lm(kind)
    x, y, sample_weight = make_data()
    history = lm.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )
    generated = lm.generate(prompts(), max_length=SEQ_LEN, stop_token_ids=None)
    return {
        "history": history.history,
        "weights": {v.path: np.array(v.numpy()) for v in lm.weights},
        "tokens": np.asarray(generated["token_ids"]),
        "placements": placements(lm),
        "expected_placements": (
            expected_placements(lm, layout_map) if layout_map else None
        ),
    }
