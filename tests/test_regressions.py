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


# Ops keras-hub's causal LMs needed (the models themselves:
# tests/test_keras_hub_catalogue.py).


def _ops_on_sharded_operands(rank, world_size):
    """Gemma's uneven key kernel, sampling's slice_update and while_loop."""
    import torch

    import keras
    from keras import ops
    from tests import distributions

    distribution = distributions.use_model_parallel(
        layout_rules={"key/kernel": ("model", None, None)}, mesh_shape=(1, 2)
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 5)).astype("float32")
    # One head on a model axis of 2: shards of 1 and 0 heads.
    key = keras.layers.EinsumDense(
        "btd,ndh->btnh", output_shape=(None, 1, 4), name="key"
    )
    key.build(x.shape)
    kernel = key.kernel.value
    outputs = {
        "kernel_placements": str(tuple(kernel.placements)),
        "einsum": ops.convert_to_numpy(key(x)),
        "kernel": ops.convert_to_numpy(kernel),
    }
    # A batch-sharded prompt updated at a tensor index, as samplers do.
    prompt = keras.distribution.distribute_tensor(
        np.arange(12, dtype="int32").reshape(4, 3),
        distribution.get_data_layout((4, 3)),
    )
    index = torch.tensor(1)
    update = np.full((4, 1), -1, dtype="int32")
    outputs["slice_update"] = ops.convert_to_numpy(
        ops.slice_update(prompt, [0, index], update)
    )
    # A loop body mixing the sharded loop variable with plain tensors.
    _, total = ops.while_loop(
        lambda i, v: i < 3,
        lambda i, v: (i + 1, v + ops.ones((4, 3), dtype="int32") * i),
        (0, prompt),
    )
    outputs["while_loop"] = ops.convert_to_numpy(total)
    return outputs


def test_ops_on_sharded_operands():
    per_rank = run_on_ranks(_ops_on_sharded_operands, world_size=2)
    prompt = np.arange(12, dtype="int32").reshape(4, 3)
    updated = prompt.copy()
    updated[:, 1] = -1
    for result in per_rank:
        assert "Shard(dim=0)" in result["kernel_placements"], result
        x = np.random.default_rng(0).normal(size=(2, 3, 5)).astype("float32")
        np.testing.assert_allclose(
            result["einsum"],
            np.einsum("btd,ndh->btnh", x, result["kernel"]),
            rtol=1e-5,
            atol=1e-6,
        )
        np.testing.assert_array_equal(result["slice_update"], updated)
        np.testing.assert_array_equal(result["while_loop"], prompt + 3)
    pm.assert_ranks_agree(per_rank)


def _sharded_lookup(rank, world_size):
    """An embedding sharded like keras-hub's, looked up by sharded ids."""
    import keras
    from keras import ops
    from tests import distributions

    distribution = distributions.use_model_parallel(
        layout_rules={"embedding/embeddings": ("model", "batch")},
        mesh_shape=(2, 2),
    )
    embedding = keras.layers.Embedding(16, 4, name="embedding")
    embedding.build((None, 3))
    ids = keras.distribution.distribute_tensor(
        np.arange(12, dtype="int32").reshape(4, 3),
        distribution.get_data_layout((4, 3)),
    )
    return {
        "table": ops.convert_to_numpy(embedding.embeddings),
        "lookup": ops.convert_to_numpy(embedding(ids)),
    }


def test_lookup_in_table_sharded_on_both_axes():
    per_rank = run_on_ranks(_sharded_lookup, world_size=4)
    ids = np.arange(12).reshape(4, 3)
    for result in per_rank:
        np.testing.assert_array_equal(result["lookup"], result["table"][ids])
    pm.assert_ranks_agree(per_rank)
