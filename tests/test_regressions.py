"""Failures reported on particular layouts, each kept fixed by a test.

Each run function builds and fits a small model, in one process
(`setting=None`, the reference, computed in the pytest process: the
single-process path is upstream's, see test_single_process_path.py) or
under the layout given, on real gloo ranks.
"""

import numpy as np

from tests import parity_models as pm
from tests.harness import run_on_ranks


def _set_model_parallel(mesh_shape, rules):
    import keras

    mesh = keras.distribution.DeviceMesh(
        mesh_shape, ["batch", "model"], keras.distribution.list_devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, layout in rules.items():
        layout_map[key] = layout
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )


def _fit(model, x, y):
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    weights = [np.array(w) for w in model.get_weights()]
    return {"loss": history.history["loss"], "weights": weights}


def _in_place_after_row_parallel_fit(setting=None):
    """A layer that updates its input in place, after a Megatron pair.

    The replicated output of the row-parallel layer (reduced as the layer
    returns) was an autograd Function's view, which torch forbids to update
    in place ("Output 0 of _ReducePartialGradient is a view and is being
    modified inplace": keras-hub's QwenMoe, Gemma3, RWKV7).
    """
    import keras

    class ScaleInPlace(keras.layers.Layer):
        def call(self, x):
            return x.mul_(2.0)

    if setting == "mp":
        _set_model_parallel(
            (1, 2),
            {".*up/kernel": (None, "model"), ".*down/kernel": ("model", None)},
        )
    keras.utils.set_random_seed(pm.SEED)
    inputs = keras.Input((4,))
    x = keras.layers.Dense(8, name="up")(inputs)
    x = keras.layers.Dense(4, name="down")(x)
    x = ScaleInPlace()(keras.layers.LayerNormalization()(x))
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 4)).astype("float32")
    y = rng.normal(size=(10, 2)).astype("float32")
    return _fit(model, x, y)


def _embedding_over_two_axes_fit(setting=None):
    """An `Embedding` table sharded over both mesh axes on one dimension,
    `TensorLayout((("batch", "model"), None))` on a 2x2 mesh ("MaskBuffer
    has been materialized with conflicting data")."""
    import keras

    if setting == "2x2":
        _set_model_parallel(
            (2, 2), {".*emb/embeddings": (("batch", "model"), None)}
        )
    keras.utils.set_random_seed(pm.SEED)
    inputs = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(16, 4, name="emb")(inputs)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, size=(10, 6)).astype("int32")
    y = rng.normal(size=(10, 2)).astype("float32")
    return _fit(model, x, y)


def _fori_loop_outside_layers(setting=None):
    """A `fori_loop` whose body mixes a layer's output with plain tensors,
    run outside any layer call (keras-hub's RWKV7 generation calls its
    layers' `call` directly: "aten.mul.Tensor got mixed torch.Tensor and
    DTensor")."""
    import keras

    if setting == "dp":
        keras.distribution.set_distribution(keras.distribution.DataParallel())
    keras.utils.set_random_seed(pm.SEED)
    layer = keras.layers.Dense(3)
    scale = layer(np.ones((2, 3), "float32"))
    state = keras.ops.ones((2, 3))

    def step(i, value):
        # `value` and `i` are plain tensors, `scale` the layer's output.
        return value * scale + keras.ops.cast(i, "float32")

    result = keras.ops.fori_loop(0, 3, step, state)
    return {"result": keras.ops.convert_to_numpy(result)}


def _call_body(rank, world_size, function, setting):
    return function(setting)


def _check(function, setting, world_size):
    per_rank = run_on_ranks(
        _call_body, world_size=world_size, args=(function, setting)
    )
    reference = pm.run_single(function)
    for rank, result in enumerate(per_rank):
        pm.assert_close(result, reference, f"rank {rank}")
    pm.assert_ranks_agree(per_rank)


def test_layer_output_updated_in_place_after_a_row_parallel_layer():
    _check(_in_place_after_row_parallel_fit, "mp", world_size=2)


def test_embedding_sharded_over_both_axes_of_a_2x2_mesh():
    _check(_embedding_over_two_axes_fit, "2x2", world_size=4)


def _scope_entered_on_one_process(rank, world_size):
    import torch
    import torch.distributed as dist

    import keras

    # Each process' torch generator differs until a distribution is set.
    torch.manual_seed(rank)
    distribution = keras.distribution.DataParallel()
    with distribution.scope():
        agreed = torch.rand(3)
    if rank == 0:
        # Only process 0 enters the scope again (e.g. around its logging):
        # it must not wait in a collective the others never join.
        for _ in range(3):
            with distribution.scope():
                pass
    total = torch.ones(1)
    dist.all_reduce(total)
    return agreed.numpy(), float(total)


def test_entering_a_scope_again_is_no_collective():
    (first, total_0), (second, total_1) = run_on_ranks(
        _scope_entered_on_one_process, world_size=2, timeout=60
    )
    # The first entry gave both processes process 0's generator state.
    np.testing.assert_array_equal(first, second)
    assert total_0 == total_1 == 2.0


def test_fori_loop_outside_layer_calls():
    _check(_fori_loop_outside_layers, "dp", world_size=2)
