"""`ModelParallel` of a convolution sharded on its output channels and of a
recurrent layer whose several outputs take one layout, on 2 gloo ranks: the
losses and weights of one process.

DTensor's convolution rule keeps the input's placements whatever the
kernel's, so a kernel sharded on its output channels gave each process its
channels labelled as the whole output, and its backward pass failed; a
layer's `/output` layout was applied to its tuple of outputs as to one
tensor, which failed while the model was built.
"""

import numpy as np
import pytest

from tests.harness import run_on_ranks

RTOL = 1e-4
ATOL = 1e-6
LAYOUTS = {
    "conv": {
        "conv/kernel": (None, None, None, "model"),
        "conv/bias": ("model",),
    },
    "lstm": {
        "lstm/lstm_cell/kernel": (None, "model"),
        "lstm/lstm_cell/recurrent_kernel": (None, "model"),
        "lstm/output": ("batch", None),
    },
}
INPUT_SHAPES = {"conv": (6, 6, 2), "lstm": (4, 3)}
SHARDED = {"conv": "conv/kernel", "lstm": "lstm/lstm_cell/kernel"}


def _model(kind):
    import keras
    from keras import layers

    inputs = keras.Input(INPUT_SHAPES[kind])
    if kind == "conv":
        x = layers.Conv2D(4, 3, padding="same", activation="relu", name="conv")(
            inputs
        )
        x = layers.GlobalAveragePooling2D()(x)
    else:
        output, state_h, _ = layers.LSTM(6, return_state=True, name="lstm")(
            inputs
        )
        x = layers.Concatenate()([output, state_h])
    return keras.Model(inputs, layers.Dense(1, name="out")(x))


def _fit(kind, weights, x, y):
    """`(losses, weights, the sharded variable's placements)` of a fit."""
    import keras

    model = _model(kind)
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    variable = next(v for v in model.variables if v.path == SHARDED[kind])
    placements = str(getattr(variable.value, "placements", None))
    return history.history["loss"], model.get_weights(), placements


def _fit_body(rank, world_size, kind):
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, *INPUT_SHAPES[kind])).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    keras.utils.set_random_seed(1)
    initial = _model(kind).get_weights()
    expected = _fit(kind, initial, x, y)
    mesh = keras.distribution.DeviceMesh((1, world_size), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    for path, axes in LAYOUTS[kind].items():
        layout_map[path] = axes
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map,
            batch_dim_name="batch",
            auto_shard_dataset=False,
        )
    )
    return expected, _fit(kind, initial, x, y)


@pytest.mark.parametrize("kind", ["conv", "lstm"])
def test_model_parallel_trains_to_one_process_numbers(kind):
    results = run_on_ranks(_fit_body, world_size=2, args=(kind,))
    for expected, (losses, weights, placements) in results:
        assert "Shard(dim=" in placements, placements
        np.testing.assert_allclose(losses, expected[0], rtol=RTOL, atol=ATOL)
        assert len(weights) == len(expected[1])
        for actual, reference in zip(weights, expected[1]):
            np.testing.assert_allclose(actual, reference, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(results[0][1][0], results[1][1][0])


def _nested_body(rank, world_size):
    import keras

    mesh = keras.distribution.DeviceMesh((world_size,), ["model"])
    layout = keras.distribution.TensorLayout(("model", None), mesh)
    x = np.arange(8.0, dtype="float32").reshape(4, 2)
    out = keras.distribution.distribute_tensor((x, {"y": [x + 1]}), layout)
    return [
        (type(t).__name__, str(t.placements), t.to_local().tolist())
        for t in (out[0], out[1]["y"][0])
    ]


def test_distribute_tensor_lays_out_each_tensor_of_a_structure():
    results = run_on_ranks(_nested_body, world_size=2)
    for rank, leaves in enumerate(results):
        rows = np.arange(8.0).reshape(4, 2)[2 * rank : 2 * rank + 2]
        assert leaves == [
            ("DTensor", "(Shard(dim=0),)", rows.tolist()),
            ("DTensor", "(Shard(dim=0),)", (rows + 1).tolist()),
        ]
