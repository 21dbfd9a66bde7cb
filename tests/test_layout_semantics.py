"""Multi-rank tests of how layouts meet tensors, and of integer variables.

1. A layout with fewer entries than the tensor's rank lays out the leading
   dimensions and replicates the trailing ones, as a shorter
   `jax.sharding.PartitionSpec` does, wherever a layout meets a tensor:
   variables, `distribute_tensor`, layer `/output` layouts and data
   inputs. One `/output` layout thus applies to every leaf of a layer's
   outputs, whatever each leaf's rank (an LSTM's rank-3 sequence and its
   rank-2 states). A layout with more entries than the rank is a
   `ValueError`.
2. Variables created from integer (or bool) data hold that dtype and those
   values on every rank, as one process does.

Bodies (`_..._body`) run on 2 gloo ranks through `tests.harness`; the
single-process references are computed in the pytest process, with no
distribution set, from the same module-level builders.
"""

import functools

import numpy as np
import pytest

from tests import distributions
from tests.harness import run_on_ranks

# Generous: the machine is small and shared, a loaded run must not flake.
MULTIRANK_TIMEOUT = 180
SEED = 1234
RTOL, ATOL = 1e-4, 1e-6


def _placements_of(tensor):
    """Placements of a DTensor as strings; None for a plain tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return None
    return tuple(str(p) for p in tensor.placements)


def _placements(*names):
    """Placement strings: `"R"` is `Replicate()`, an int `d` is `Shard(d)`."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard

    return tuple(str(Replicate() if n == "R" else Shard(n)) for n in names)


def _local_numpy(tensor):
    """This rank's own data of a (D)Tensor, as numpy."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.detach().cpu().numpy()


def _rows_of(value, rank, world_size, axis=0):
    """The part of `value` along `axis` that `torch.chunk` gives `rank`."""
    import torch

    return torch.chunk(torch.as_tensor(value), world_size, dim=axis)[
        rank
    ].numpy()


def _mesh(shape):
    """A ("batch", "model") `DeviceMesh` of `shape` over all processes."""
    from keras import distribution as kd

    return kd.DeviceMesh(shape, ["batch", "model"], kd.list_devices())


def _set_model_parallel(mesh_shape, layouts):
    """Sets `ModelParallel` with a `LayoutMap` of `{key: axes}`."""
    from keras import distribution as kd

    layout_map = kd.LayoutMap(_mesh(mesh_shape))
    for key, axes in layouts.items():
        layout_map[key] = axes
    kd.set_distribution(
        kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )


_single_process = distributions.run_without_distribution


# --------------------------------------------------------------------------
# 1. A shorter layout replicates the trailing dimensions
# --------------------------------------------------------------------------

_LSTM_OUTPUT_LAYOUT = {".*lstm/output": ("batch", None)}
# mesh shape (None: DataParallel) and LayoutMap of each setting.
_LSTM_SETTINGS = {
    # Control: DataParallel has no LayoutMap, so no `/output` layout.
    "data_parallel": (None, {}),
    # The `/output` layout really splits the batch of all three outputs.
    "batch_sharded": ((2, 1), _LSTM_OUTPUT_LAYOUT),
    # Column-parallel LSTM kernels, and the same `/output` layout.
    "model_sharded": (
        (1, 2),
        {
            "lstm/lstm_cell/kernel": (None, "model"),
            "lstm/lstm_cell/recurrent_kernel": (None, "model"),
            **_LSTM_OUTPUT_LAYOUT,
        },
    ),
}


def _lstm_data(num_samples, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.0, 1.0, size=(num_samples, 4, 3)).astype("float32")
    flat = x.reshape(num_samples, -1)
    y = np.stack(
        [flat.sum(-1), flat[:, 0] * flat[:, -1], np.abs(flat).mean(-1)],
        axis=-1,
    ).astype("float32")
    return x, y


def _lstm_fit():
    """Trains an LSTM returning its sequence (rank 3) and states (rank 2).

    Returns:
        The per-epoch losses, the final weights by path, and the rank and
        placements of each output of the LSTM called on a batch.
    """
    import keras
    from keras import layers

    keras.utils.set_random_seed(SEED)
    inputs = layers.Input((4, 3))
    sequence, state_h, state_c = layers.LSTM(
        6, return_sequences=True, return_state=True, name="lstm"
    )(inputs)
    pooled = layers.GlobalAveragePooling1D(name="pool")(sequence)
    merged = layers.Concatenate(name="concat")([pooled, state_h, state_c])
    model = keras.Model(inputs, layers.Dense(3, name="out")(merged))
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=0.01, epsilon=1e-3),
        loss="mse",
    )
    x, y = _lstm_data(24)
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    outputs = model.get_layer("lstm")(x[:8])
    return {
        "loss": [float(v) for v in history.history["loss"]],
        "weights": {v.path: np.array(v.numpy()) for v in model.weights},
        "outputs": [(o.ndim, _placements_of(o)) for o in outputs],
    }


@functools.lru_cache(maxsize=None)
def _lstm_reference():
    """`_lstm_fit` in this process, with no distribution (once)."""
    return _single_process(_lstm_fit)


def _lstm_body(rank, world_size, setting):
    from keras import distribution as kd

    mesh_shape, layouts = _LSTM_SETTINGS[setting]
    if mesh_shape is None:
        kd.set_distribution(kd.DataParallel())
    else:
        _set_model_parallel(mesh_shape, layouts)
    return _lstm_fit()


@pytest.mark.parametrize("setting", sorted(_LSTM_SETTINGS))
def test_one_output_layout_lays_out_lstm_sequence_and_states(setting):
    reference = _lstm_reference()
    results = run_on_ranks(_lstm_body, world_size=2, args=(setting,))
    for result in results:
        np.testing.assert_allclose(
            result["loss"], reference["loss"], rtol=RTOL, atol=ATOL
        )
        assert sorted(result["weights"]) == sorted(reference["weights"])
        for path, value in reference["weights"].items():
            np.testing.assert_allclose(
                result["weights"][path],
                value,
                rtol=RTOL,
                atol=ATOL,
                err_msg=path,
            )
        ranks = [ndim for ndim, _ in result["outputs"]]
        assert ranks == [3, 2, 2]
        if setting == "batch_sharded":
            # ("batch", None) shards the batch of every output, whatever
            # its rank; the trailing dimensions are replicated.
            for _, placements in result["outputs"]:
                assert placements == _placements(0, "R")
        if setting == "model_sharded":
            # The "batch" axis has size 1 here: it shards nothing, and the
            # outputs are replicated on it.
            for _, placements in result["outputs"]:
                assert placements == _placements("R", "R")


def _short_layouts_body(rank, world_size):
    import torch

    import keras
    from keras import distribution as kd
    from keras.src.backend.torch import distribution_lib

    _set_model_parallel(
        (1, world_size),
        {"rows": ("model",), "columns": (None, "model"), "empty": ()},
    )
    mesh = kd.distribution().device_mesh
    value = torch.arange(4 * 5 * 3, dtype=torch.float32).reshape(4, 5, 3)
    results = {}
    # distribute_tensor: a leaf of each rank under one short layout.
    for name, axes, x in (
        ("rank3_model_on_0", ("model",), value),
        ("rank3_model_on_1", (None, "model"), value),
        ("rank2_model_on_0", ("model",), value[0]),
        ("rank1_model_on_0", ("model",), value[0, :, 0]),
        ("rank2_empty", (), value[0]),
    ):
        out = distribution_lib.distribute_tensor(x, kd.TensorLayout(axes, mesh))
        results[name] = (
            _placements_of(out),
            _local_numpy(out),
            out.full_tensor().numpy(),
        )
    nested = distribution_lib.distribute_tensor(
        (value, value[:, 0]), kd.TensorLayout(("model", None), mesh)
    )
    results["nested"] = [
        (_placements_of(o), _local_numpy(o), o.full_tensor().numpy())
        for o in nested
    ]
    # Variables laid out by LayoutMap rules shorter than their rank.
    keras.utils.set_random_seed(SEED)
    for name, shape in (
        ("rows", (5, 3)),
        ("columns", (4, 5, 3)),
        ("empty", (2, 3)),
    ):
        variable = keras.Variable(
            np.arange(np.prod(shape), dtype="float32").reshape(shape),
            name=name,
        )
        variable.assign(variable.numpy() + 1.0)
        results[f"variable_{name}"] = (
            _placements_of(variable.value),
            _local_numpy(variable.value),
            variable.numpy(),
        )
    # Data inputs: this rank's rows of a rank-3 batch, laid out ("batch",).
    batch_mesh = _mesh((world_size, 1))
    part = _rows_of(value.numpy(), rank, world_size)
    batch = distribution_lib.distribute_data_input(
        part, kd.TensorLayout(("batch",), batch_mesh), "batch"
    )
    results["data_input"] = (
        _placements_of(batch),
        _local_numpy(batch),
        batch.full_tensor().numpy(),
    )
    return results


def test_shorter_layouts_replicate_the_trailing_dimensions():
    results = run_on_ranks(_short_layouts_body, world_size=2)
    value = np.arange(4 * 5 * 3, dtype=np.float32).reshape(4, 5, 3)
    expected = {
        "rank3_model_on_0": (_placements("R", 0), value, 0),
        "rank3_model_on_1": (_placements("R", 1), value, 1),
        "rank2_model_on_0": (_placements("R", 0), value[0], 0),
        "rank1_model_on_0": (_placements("R", 0), value[0, :, 0], 0),
        "rank2_empty": (_placements("R", "R"), value[0], None),
        "variable_rows": (
            _placements("R", 0),
            np.arange(15.0).reshape(5, 3) + 1,
            0,
        ),
        "variable_columns": (
            _placements("R", 1),
            np.arange(60.0).reshape(4, 5, 3) + 1,
            1,
        ),
        "variable_empty": (
            _placements("R", "R"),
            np.arange(6.0).reshape(2, 3) + 1,
            None,
        ),
        "data_input": (_placements(0, "R"), value, 0),
    }
    for rank, result in enumerate(results):
        cases = dict(expected)
        cases["nested_0"] = (_placements("R", 0), value, 0)
        cases["nested_1"] = (_placements("R", 0), value[:, 0], 0)
        result["nested_0"], result["nested_1"] = result.pop("nested")
        assert sorted(result) == sorted(cases)
        for name, (placements, full, axis) in cases.items():
            got_placements, local, got_full = result[name]
            assert got_placements == placements, name
            np.testing.assert_array_equal(got_full, full, err_msg=name)
            local_expected = (
                full if axis is None else _rows_of(full, rank, 2, axis)
            )
            np.testing.assert_array_equal(local, local_expected, err_msg=name)


def _longer_layouts_body(rank, world_size):
    import torch
    import torch.distributed as dist

    import keras
    from keras import distribution as kd
    from keras.src.backend.torch import distribution_lib

    _set_model_parallel(
        (1, world_size), {"dense/kernel": (None, "model", None)}
    )
    mesh = kd.distribution().device_mesh
    too_long = kd.TensorLayout((None, "model", None), mesh)
    attempts = {
        "tensor": lambda: distribution_lib.distribute_tensor(
            torch.ones(4, 6), too_long
        ),
        "variable": lambda: keras.layers.Dense(6, name="dense").build((5,)),
        "data_input": lambda: distribution_lib.distribute_data_input(
            np.ones((4, 6), "float32"),
            kd.TensorLayout(("batch", None, None), mesh),
            "batch",
        ),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
    # Every rank must get here: nobody waits in a collective.
    dist.barrier()
    return messages


def test_longer_layouts_raise_a_value_error():
    expected = {
        "tensor": ["tensor", "3 axes", "rank 2", "(4, 6)"],
        "variable": ["'dense/kernel'", "3 axes", "rank 2", "(5, 6)"],
        "data_input": ["data input", "3 axes", "rank 2"],
    }
    for messages in run_on_ranks(_longer_layouts_body, world_size=2):
        assert sorted(messages) == sorted(expected)
        for name, parts in expected.items():
            assert messages[name] is not None, f"{name}: no ValueError"
            for part in parts:
                assert part in messages[name], (name, part, messages[name])
            assert "at most one entry per tensor dimension" in messages[name]


# --------------------------------------------------------------------------
# 2. Variables created from integer data
# --------------------------------------------------------------------------

# name -> keyword arguments of `keras.Variable`.
_INT_VARIABLES = {
    "ints_2d": {"initializer": np.arange(8).reshape(2, 4)},
    "ints_2d_int32": {
        "initializer": np.arange(8).reshape(2, 4),
        "dtype": "int32",
    },
    "ints_list": {"initializer": [1, 2, 3]},
    "ints_list_int32": {"initializer": [1, 2, 3], "dtype": "int32"},
    "flags": {"initializer": [True, False, True, False]},
    "floats_list": {"initializer": [1, 2, 3], "dtype": "float32"},
}
# The LayoutMap rules of the model-parallel setting: every variable sharded.
_INT_LAYOUTS = {
    "ints_2d.*": (None, "model"),
    "ints_list.*": ("model",),
    "flags": ("model",),
    "floats_list": ("model",),
}


def _int_variables():
    """Creates the `_INT_VARIABLES`; returns what a test checks of each."""
    import keras

    results = {}
    for name, kwargs in _INT_VARIABLES.items():
        variable = keras.Variable(name=name, **kwargs)
        results[name] = {
            "dtype": variable.dtype,
            "torch_dtype": str(variable.value.dtype),
            "trainable": variable.trainable,
            "requires_grad": bool(variable.value.requires_grad),
            "numpy": variable.numpy(),
            "placements": _placements_of(variable.value),
        }
    return results


def _int_variables_body(rank, world_size, setting):
    from keras import distribution as kd

    if setting == "data_parallel":
        kd.set_distribution(kd.DataParallel())
    else:
        _set_model_parallel((1, world_size), _INT_LAYOUTS)
    return _int_variables()


@pytest.mark.parametrize("setting", ["data_parallel", "model_parallel"])
def test_variables_from_integer_data(setting):
    results = run_on_ranks(_int_variables_body, world_size=2, args=(setting,))
    reference = _single_process(_int_variables)
    expected_values = {
        "ints_2d": np.arange(8).reshape(2, 4),
        "ints_2d_int32": np.arange(8, dtype="int32").reshape(2, 4),
        "ints_list": np.array([1, 2, 3], "int32"),
        "ints_list_int32": np.array([1, 2, 3], "int32"),
        "flags": np.array([True, False, True, False]),
        "floats_list": np.array([1.0, 2.0, 3.0], "float32"),
    }
    for name, value in expected_values.items():
        # One process: the initializer's dtype, or the one asked for.
        assert reference[name]["dtype"] == str(value.dtype), name
        np.testing.assert_array_equal(reference[name]["numpy"], value)
        assert reference[name]["requires_grad"] == (name == "floats_list")
    for result in results:
        for name, expected in reference.items():
            got = result[name]
            for key in ("dtype", "torch_dtype", "trainable", "requires_grad"):
                assert got[key] == expected[key], (name, key)
            assert got["numpy"].dtype == expected["numpy"].dtype, name
            np.testing.assert_array_equal(got["numpy"], expected["numpy"])
            if setting == "data_parallel":
                assert got["placements"] == _placements("R"), name
            else:
                axis = 1 if name.startswith("ints_2d") else 0
                assert got["placements"] == _placements("R", axis), name
