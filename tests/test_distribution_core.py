"""Multi-rank tests of the core of the torch distribution backend.

Covers `keras/src/backend/torch/distribution_lib.py` and the Keras
`keras.distribution` API on top of it: device meshes, layouts and their
DTensor placements, distributed variables and their assignment, layer
outputs, data inputs, collectives, thread safety, variable paths, debug
logging and the sharding summary. Error cases live in
`tests/test_distribution_errors.py`.

Bodies (`_..._body`) run on real gloo ranks through `tests.harness`; the
single-process references are computed in the pytest process itself, with
no distribution set, from the same module-level builders.
"""

import logging
import os
import re
import subprocess
import sys
import uuid

import numpy as np
import pytest

from tests import distributions
from tests.harness import run_on_ranks

SEED = 1234
RTOL, ATOL = 1e-4, 1e-6


# --------------------------------------------------------------------------
# Helpers shared by bodies and references
# --------------------------------------------------------------------------


def _assert_close(actual, expected):
    """Float parity with the project's tolerances."""
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL)


def _placement_strings(*placements):
    """The strings DTensor prints for `placements` (torch objects)."""
    return tuple(str(p) for p in placements)


def _shard(dim):
    from torch.distributed.tensor import Shard

    return Shard(dim)


def _replicate():
    from torch.distributed.tensor import Replicate

    return Replicate()


def _placements_of(tensor):
    """Placements of a DTensor as strings; None for a plain tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return None
    return tuple(str(p) for p in tensor.placements)


def _is_sharded(placements):
    """Whether placement strings (or None: a plain tensor) shard anything."""
    return placements is not None and any(
        p != str(_replicate()) for p in placements
    )


def _local_numpy(tensor):
    """This rank's own data of a (D)Tensor, as numpy."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.detach().cpu().numpy()


def _chunk_sizes(size, *, parts):
    """Sizes of the parts `torch.chunk` cuts `size` rows into (0-padded)."""
    import torch

    sizes = [len(c) for c in torch.arange(size).chunk(parts)]
    return sizes + [0] * (parts - len(sizes))


def _dense_weights(*, units, input_dim, name="dense"):
    """Builds a seeded Dense layer; returns it (no distribution needed)."""
    import keras

    keras.utils.set_random_seed(SEED)
    layer = keras.layers.Dense(units, name=name)
    layer.build((None, input_dim))
    return layer


def _reference(fn, *args, **kwargs):
    """Runs a builder in the pytest process, with a fresh Keras state."""
    import keras

    keras.backend.clear_session()
    try:
        return fn(*args, **kwargs)
    finally:
        keras.backend.clear_session()


def _inputs(shape, *, seed=0):
    """Deterministic float32 inputs, the same in every process."""
    return np.random.RandomState(seed).rand(*shape).astype("float32")


# --------------------------------------------------------------------------
# 1. Mesh conversion
# --------------------------------------------------------------------------


def _mesh_body(rank, world_size, mesh_shape, device_order):
    import torch

    from keras import distribution as kd
    from keras.src.backend.torch import distribution_lib

    devices = [f"cpu:{i}" for i in device_order]
    # The mesh conversion is under test: built with the Keras API itself.
    mesh = kd.DeviceMesh(
        mesh_shape, ["batch", "model"][: len(mesh_shape)], devices
    )
    torch_mesh = mesh.backend_mesh
    # Sharded on the first mesh axis: shows which rank holds which block.
    value = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    layout = kd.TensorLayout(("batch", None), mesh)
    shard = distribution_lib.distribute_tensor(value, layout)
    return {
        "dim_names": tuple(torch_mesh.mesh_dim_names),
        "mesh": torch_mesh.mesh.tolist(),
        "coordinate": tuple(torch_mesh.get_coordinate()),
        "info": kd.mesh_info(mesh),
        "local": _local_numpy(shard),
    }


@pytest.mark.parametrize(
    "world_size,mesh_shape,device_order",
    [
        (2, (2,), (0, 1)),
        (2, (2,), (1, 0)),
        (4, (2, 2), (0, 1, 2, 3)),
        (4, (2, 2), (3, 1, 0, 2)),
    ],
    ids=["1d", "1d-reversed", "2x2", "2x2-permuted"],
)
def test_mesh_follows_keras_devices(world_size, mesh_shape, device_order):
    results = run_on_ranks(
        _mesh_body, world_size=world_size, args=(mesh_shape, device_order)
    )
    expected_mesh = np.array(device_order).reshape(mesh_shape)
    names = ("batch", "model")[: len(mesh_shape)]
    value = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    for rank, result in enumerate(results):
        coordinate = tuple(
            int(i) for i in np.argwhere(expected_mesh == rank)[0]
        )
        assert result["dim_names"] == names
        assert result["mesh"] == expected_mesh.tolist()
        assert result["coordinate"] == coordinate
        info = result["info"]
        assert info["shape"] == tuple(mesh_shape)
        assert info["axis_names"] == names
        assert (
            info["devices"]
            == np.array([f"cpu:{i}" for i in device_order])
            .reshape(mesh_shape)
            .tolist()
        )
        assert info["process_id"] == rank
        assert info["num_processes"] == world_size
        assert info["coordinate"] == coordinate
        # The block along "batch" is the one at this rank's mesh position.
        blocks = np.split(value, mesh_shape[0])
        np.testing.assert_array_equal(result["local"], blocks[coordinate[0]])


# --------------------------------------------------------------------------
# 2. Layouts -> placements
# --------------------------------------------------------------------------

_LAYOUT_CASES = {
    "model_on_dim1": (None, "model"),
    "batch_on_dim0": ("batch", None),
    "both_on_dim0": (("batch", "model"), None),
    "transposed": ("model", "batch"),
    "replicated": (None, None),
}


def _layout_body(rank, world_size):
    import torch

    from keras import distribution as kd
    from keras.src.backend.torch import distribution_lib

    mesh = distributions.device_mesh((2, 2))
    placements = {
        name: tuple(
            str(p)
            for p in kd.TensorLayout(axes, mesh).backend_layout.placements
        )
        for name, axes in _LAYOUT_CASES.items()
    }
    value = torch.arange(8 * 2, dtype=torch.float32).reshape(8, 2)
    both = distribution_lib.distribute_tensor(
        value, kd.TensorLayout(_LAYOUT_CASES["both_on_dim0"], mesh)
    )
    return {
        "placements": placements,
        "both_local": _local_numpy(both),
        "both_global": both.full_tensor().numpy(),
    }


def test_layout_placements_on_2x2_mesh():
    results = run_on_ranks(_layout_body, world_size=4)
    replicate, shard0, shard1 = _replicate(), _shard(0), _shard(1)
    expected = {
        "model_on_dim1": _placement_strings(replicate, shard1),
        "batch_on_dim0": _placement_strings(shard0, replicate),
        "both_on_dim0": _placement_strings(shard0, shard0),
        "transposed": _placement_strings(shard1, shard0),
        "replicated": _placement_strings(replicate, replicate),
    }
    value = np.arange(8 * 2, dtype=np.float32).reshape(8, 2)
    mesh = np.arange(4).reshape(2, 2)
    for rank, result in enumerate(results):
        assert result["placements"] == expected
        # JAX's P(("batch", "model")): the device at mesh position (b, m)
        # holds block b * model_size + m of the dimension.
        b, m = np.argwhere(mesh == rank)[0]
        block = b * mesh.shape[1] + m
        np.testing.assert_array_equal(
            result["both_local"], np.split(value, 4)[block]
        )
        np.testing.assert_array_equal(result["both_global"], value)


def _uneven_body(rank, world_size):
    import torch

    from keras import distribution as kd
    from keras.src.backend.torch import distribution_lib

    mesh = distributions.device_mesh((1, world_size))
    value = torch.arange(31 * 3, dtype=torch.float32).reshape(31, 3)
    layout = kd.TensorLayout(("model", None), mesh)
    sharded = distribution_lib.distribute_tensor(value, layout)
    column_layout = kd.TensorLayout((None, "model"), mesh)
    return {
        "placements": _placements_of(sharded),
        "column_placements": tuple(
            str(p) for p in column_layout.backend_layout.placements
        ),
        "local": _local_numpy(sharded),
        "global": sharded.full_tensor().numpy(),
    }


def test_uneven_dimension_is_chunked_like_torch_chunk():
    results = run_on_ranks(_uneven_body, world_size=2)
    value = np.arange(31 * 3, dtype=np.float32).reshape(31, 3)
    sizes = _chunk_sizes(31, parts=2)
    assert sizes == [16, 15]
    starts = np.cumsum([0] + sizes)
    for rank, result in enumerate(results):
        assert result["placements"] == _placement_strings(
            _replicate(), _shard(0)
        )
        assert result["column_placements"] == _placement_strings(
            _replicate(), _shard(1)
        )
        np.testing.assert_array_equal(
            result["local"], value[starts[rank] : starts[rank + 1]]
        )
        np.testing.assert_array_equal(result["global"], value)


@pytest.mark.parametrize(
    "shape", [(), (5,), (4, 1, 7), (0, 3), (2, 0, 3), (3, 0), (2, 3, 4, 5)]
)
def test_contiguous_strides_are_torch_s(shape):
    import torch

    from keras.src.backend.torch.distributed.core import layouts

    assert layouts.contiguous_strides(shape) == torch.empty(shape).stride()
    assert layouts.contiguous_strides(torch.Size(shape)) == (
        torch.empty(shape).stride()
    )


def _too_short_body(rank, world_size):
    import torch

    from keras import distribution as kd
    from keras.src.backend.torch import distribution_lib

    mesh = distributions.device_mesh((2, 2))
    results = {}
    # Rows over 4 parts ("batch" then "model"), columns over "model".
    for rows in (1, 2, 3, 5, 7, 8):
        value = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4)
        layout = kd.TensorLayout((("batch", "model"), None), mesh)
        laid_out = distribution_lib.distribute_tensor(value, layout)
        results[rows] = {
            "placements": _placements_of(laid_out),
            "min": laid_out.min().full_tensor().item(),
            "global": laid_out.full_tensor().numpy(),
        }
    return results


def test_a_dimension_too_short_for_its_shards_is_replicated():
    def nested_sizes(rows):
        # DTensor cuts over "batch", then each part over "model".
        return [
            size
            for part in _chunk_sizes(rows, parts=2)
            for size in _chunk_sizes(part, parts=2)
        ]

    # 1, 2 and 3 rows leave a process an empty part; 5, 7 and 8 do not.
    assert [0 in nested_sizes(n) for n in (1, 2, 3, 5, 7, 8)] == [
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    for result in run_on_ranks(_too_short_body, world_size=4):
        for rows, laid_out in result.items():
            value = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
            if 0 in nested_sizes(rows):
                expected = (_replicate(), _replicate())
            else:
                expected = (_shard(0), _shard(0))
            assert laid_out["placements"] == _placement_strings(*expected)
            # `min` has no identity: on an empty part it would fail on
            # that process alone.
            assert laid_out["min"] == 0.0
            np.testing.assert_array_equal(laid_out["global"], value)


def _unit_axis_body(rank, world_size):
    import torch

    from keras import distribution as kd
    from keras.src.backend.torch import distribution_lib

    mesh = distributions.device_mesh((1, 2))
    value = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    results = {}
    for axes in (("batch", "model"), ("batch", None), ("model", None)):
        laid_out = distribution_lib.distribute_tensor(
            value, kd.TensorLayout(axes, mesh)
        )
        results[axes] = _placements_of(laid_out)
    return results


def test_a_mesh_axis_of_size_one_shards_nothing():
    for result in run_on_ranks(_unit_axis_body, world_size=2):
        # "batch" has size 1: the rows stay whole, as they are anyway.
        assert result[("batch", "model")] == _placement_strings(
            _replicate(), _shard(1)
        )
        assert result[("batch", None)] == _placement_strings(
            _replicate(), _replicate()
        )
        assert result[("model", None)] == _placement_strings(
            _replicate(), _shard(0)
        )


def _array_and_variable_body(rank, world_size):
    import keras
    from keras import distribution as kd
    from keras.src.backend.torch import distribution_lib

    mesh = distributions.device_mesh((world_size,), axis_names=("batch",))
    layout = kd.TensorLayout(("batch", None), mesh)
    array = np.arange(8 * 4).reshape(8, 4)
    variable = keras.Variable(np.ones((8, 4), "float32"))
    from_array = kd.distribute_tensor(array, layout)
    from_variable = distribution_lib.distribute_tensor(variable, layout)
    return {
        "array": (
            type(from_array).__name__,
            _placements_of(from_array),
            _local_numpy(from_array),
            from_array.full_tensor().numpy(),
        ),
        "variable": (
            type(from_variable).__name__,
            _local_numpy(from_variable),
        ),
        "no_layout": distribution_lib.distribute_tensor(array, None) is array,
        "no_backend_layout": distribution_lib._to_backend_layout(None),
    }


def test_numpy_arrays_and_variables_are_laid_out_as_global_values():
    # As JAX's `device_put` does; Keras master's torch
    # `distribution_lib_test.py` (`test_distribute_tensor`) and its
    # multi-process `test_distribute_variable` check it too.
    array = np.arange(8 * 4).reshape(8, 4)
    results = run_on_ranks(_array_and_variable_body, world_size=2)
    for rank, result in enumerate(results):
        kind, placements, local, full = result["array"]
        assert kind == "DTensor"
        assert placements == _placement_strings(_shard(0))
        np.testing.assert_array_equal(local, np.split(array, 2)[rank])
        np.testing.assert_array_equal(full, array)
        kind, local = result["variable"]
        assert kind == "DTensor"
        np.testing.assert_array_equal(local, np.ones((4, 4), "float32"))
        assert result["no_layout"]
        assert result["no_backend_layout"] is None


# --------------------------------------------------------------------------
# 3. Variables
# --------------------------------------------------------------------------


def _variable_facts(variable):
    """What a test checks about a distributed variable (collective)."""
    import torch

    value = variable.value
    return {
        "placements": _placements_of(value),
        "is_parameter": isinstance(value, torch.nn.Parameter),
        "requires_grad": bool(value.requires_grad),
        "global": np.asarray(variable),
        "local_shape": tuple(_local_numpy(value).shape),
    }


def _data_parallel_dense_body(rank, world_size):
    distributions.use_data_parallel()
    layer = _dense_weights(units=5, input_dim=4)
    return {
        "kernel": _variable_facts(layer.kernel),
        "bias": _variable_facts(layer.bias),
    }


def test_data_parallel_variables_are_replicated_dtensors():
    reference = _reference(_dense_weights, units=5, input_dim=4)
    results = run_on_ranks(_data_parallel_dense_body, world_size=2)
    for result in results:
        for name in ("kernel", "bias"):
            facts = result[name]
            expected = np.asarray(getattr(reference, name))
            assert facts["placements"] == _placement_strings(_replicate())
            assert facts["is_parameter"] and facts["requires_grad"]
            assert facts["local_shape"] == expected.shape
            _assert_close(facts["global"], expected)


def _replicated_locals_body(rank, world_size):
    import gc

    import torch
    from torch.distributed.tensor import Shard

    import keras
    from keras.src.backend.torch.distributed.core import layouts
    from keras.src.backend.torch.distributed.core import local_state

    distributions.use_setting("dp")
    variable = keras.Variable(np.arange(4.0, dtype="float32"))
    value = variable.value
    local = local_state.replicated_local(value)
    facts = {
        "kept": local_state.replicated_local(value) is local,
        "same_storage": local.data_ptr() == value.to_local().data_ptr(),
    }
    sharded = layouts.dtensor_from_local(
        torch.zeros(2), value.device_mesh, [Shard(0)], shape=(4,)
    )
    facts["sharded"] = local_state.replicated_local(sharded)
    with local_state.local_reads([variable]) as read_locally:
        facts["read_locally"] = read_locally
        variable.assign_add(np.ones(4, "float32"))
    facts["written_through"] = variable.value.full_tensor().tolist()
    kept = len(local_state._REPLICATED_LOCALS)
    del sharded
    variable = value = local = None
    gc.collect()
    facts["forgotten"] = kept - len(local_state._REPLICATED_LOCALS)
    keras.distribution.set_distribution(None)
    return facts


def test_replicated_local_tensors_are_kept_while_their_dtensor_lives():
    # The optimizer's and the loss tracker's replicated state is read on
    # its local tensors every step: each `DTensor`'s local tensor is taken
    # once, a sharded one never, and forgotten with its `DTensor`.
    for facts in run_on_ranks(_replicated_locals_body, world_size=2):
        assert facts == {
            "kept": True,
            "same_storage": True,
            "sharded": None,
            "read_locally": True,
            "written_through": [1.0, 2.0, 3.0, 4.0],
            "forgotten": 1,
        }


def _model_parallel_dense_body(rank, world_size, mesh_shape):
    distributions.use_model_parallel(
        layout_rules={
            "dense/kernel": ("batch", "model"),
            "dense/bias": ("model",),
        },
        mesh_shape=mesh_shape,
    )
    layer = _dense_weights(units=31, input_dim=4)
    return {
        "kernel": _variable_facts(layer.kernel),
        "bias": _variable_facts(layer.bias),
    }


@pytest.mark.parametrize(
    "world_size,mesh_shape", [(2, (1, 2)), (4, (2, 2))], ids=["1x2", "2x2"]
)
def test_model_parallel_variables_are_sharded(world_size, mesh_shape):
    reference = _reference(_dense_weights, units=31, input_dim=4)
    results = run_on_ranks(
        _model_parallel_dense_body, world_size=world_size, args=(mesh_shape,)
    )
    mesh = np.arange(world_size).reshape(mesh_shape)
    for rank, result in enumerate(results):
        b, m = np.argwhere(mesh == rank)[0]
        kernel, bias = result["kernel"], result["bias"]
        assert kernel["placements"] == _placement_strings(_shard(0), _shard(1))
        assert bias["placements"] == _placement_strings(_replicate(), _shard(0))
        assert kernel["local_shape"] == (
            _chunk_sizes(4, parts=mesh_shape[0])[b],
            _chunk_sizes(31, parts=mesh_shape[1])[m],
        )
        assert bias["local_shape"] == (
            _chunk_sizes(31, parts=mesh_shape[1])[m],
        )
        assert kernel["requires_grad"] and bias["requires_grad"]
        _assert_close(kernel["global"], np.asarray(reference.kernel))
        _assert_close(bias["global"], np.asarray(reference.bias))


def _plain_outside_distribution_body(rank, world_size):
    import keras

    before = keras.layers.Dense(3)
    before.build((None, 2))
    # Only in this scope, never set for the process.
    distribution = distributions.data_parallel()
    with distribution.scope():
        inside = keras.layers.Dense(3)
        inside.build((None, 2))
    after = keras.layers.Dense(3)
    after.build((None, 2))
    return {
        name: _placements_of(layer.kernel.value)
        for name, layer in (
            ("before", before),
            ("inside", inside),
            ("after", after),
        )
    }


def test_variables_outside_a_distribution_stay_plain():
    for result in run_on_ranks(_plain_outside_distribution_body, world_size=2):
        assert result["before"] is None
        assert result["after"] is None
        assert result["inside"] == _placement_strings(_replicate())


def _int_and_bool_variables_body(rank, world_size):
    import keras

    distributions.use_model_parallel(
        layout_rules={"counts": ("model",)}, mesh_shape=(1, world_size)
    )
    replicated = keras.Variable(
        np.arange(4), dtype="int32", trainable=False, name="steps"
    )
    sharded = keras.Variable(
        np.arange(6) * 10, dtype="int32", trainable=False, name="counts"
    )
    flags = keras.Variable(
        np.array([True, False, True]),
        dtype="bool",
        trainable=False,
        name="flags",
    )
    sharded.assign(np.arange(6, dtype="int32") * 10)
    # State without gradients is written through its local tensors: a
    # replicated value too, each process copying its own entries.
    value = sharded.value
    sharded.assign(
        value.redistribute(
            value.device_mesh, [_replicate()] * value.device_mesh.ndim
        )
        + 1
    )
    # Replicated state takes a plain value whole (a metric's reset: a
    # Python number).
    replicated.assign(np.arange(4, dtype="int32") + 5)
    flags.assign(np.array([False, True, True]))
    total = keras.Variable(1.0, trainable=False, name="total")
    total.assign(2.5)
    facts = {
        name: _variable_facts(variable)
        for name, variable in (
            ("steps", replicated),
            ("counts", sharded),
            ("flags", flags),
            ("total", total),
        )
    }
    for name, variable in (
        ("steps", replicated),
        ("counts", sharded),
        ("flags", flags),
        ("total", total),
    ):
        facts[name]["dtype"] = str(variable.value.dtype)
    return facts


def test_integer_and_bool_variables():
    results = run_on_ranks(_int_and_bool_variables_body, world_size=2)
    expected = {
        "steps": (np.arange(4) + 5, "torch.int32"),
        "counts": (np.arange(6) * 10 + 1, "torch.int32"),
        "flags": (np.array([False, True, True]), "torch.bool"),
        "total": (np.float32(2.5), "torch.float32"),
    }
    for rank, result in enumerate(results):
        for name, (value, dtype) in expected.items():
            facts = result[name]
            assert facts["dtype"] == dtype, name
            assert not facts["requires_grad"], name
            np.testing.assert_array_equal(facts["global"], value)
        assert result["steps"]["placements"] == _placement_strings(
            _replicate(), _replicate()
        )
        assert result["counts"]["placements"] == _placement_strings(
            _replicate(), _shard(0)
        )
        assert result["counts"]["local_shape"] == (
            _chunk_sizes(6, parts=2)[rank],
        )


def _unseeded_replicas_body(rank, world_size):
    import random

    import torch

    import keras

    # Every random source differs per rank, and no Keras seed is set.
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    torch.manual_seed(100 + rank)
    plain = keras.layers.Dense(4)
    plain.build((None, 3))
    distributions.use_data_parallel()
    replicated = keras.layers.Dense(4)
    replicated.build((None, 3))
    return {
        "plain": np.asarray(plain.kernel),
        "local": _local_numpy(replicated.kernel.value),
        "global": np.asarray(replicated.kernel),
    }


def test_replicated_variables_agree_without_a_keras_seed():
    results = run_on_ranks(_unseeded_replicas_body, world_size=2)
    # Sanity: without a distribution the ranks do initialize differently.
    assert not np.allclose(results[0]["plain"], results[1]["plain"])
    for result in results:
        np.testing.assert_array_equal(result["local"], results[0]["local"])
        np.testing.assert_array_equal(result["global"], results[0]["local"])


def _variable_pieces_body(rank, world_size, cases):
    from keras.src.backend.torch.distributed.core import variables

    # Pieces of 64 bytes: most values below take several broadcasts, and
    # pieces cut across shards. (The worker outlives the test: restored.)
    piece_bytes = variables.BROADCAST_PIECE_BYTES
    variables.BROADCAST_PIECE_BYTES = 64
    try:
        return _cut_variables(rank, cases)
    finally:
        variables.BROADCAST_PIECE_BYTES = piece_bytes


def _cut_variables(rank, cases):
    """Each case's variable, and torch's own cut of the same value."""
    import torch
    from torch.distributed.tensor import distribute_tensor

    from keras import distribution as kd
    from keras.src.backend.torch import distribution_lib

    mesh = distributions.device_mesh((2, 2))
    results = {}
    for name, (shape, axes, dtype) in cases.items():
        full = torch.arange(int(np.prod(shape)), dtype=torch.float64)
        full = (full * 7 % 11).reshape(shape).to(getattr(torch, dtype))
        layout = kd.TensorLayout(axes, mesh)
        # Each process' own value differs: process 0's must win.
        mine = full + rank if dtype != "bool" else full ^ bool(rank % 2)
        sharded = distribution_lib.distribute_variable(mine, layout)
        torch_layout = layout.backend_layout
        expected = distribute_tensor(
            full,
            torch_layout.device_mesh,
            torch_layout.placements,
            src_data_rank=None,
        )
        results[name] = {
            "placements": _placements_of(sharded),
            "expected_placements": _placements_of(expected),
            "local": _local_numpy(sharded),
            "expected_local": _local_numpy(expected),
            "global": sharded.full_tensor().numpy(),
            "full": full.numpy(),
        }
    return results


def test_variables_are_cut_from_process_0s_value_in_pieces():
    cases = {
        "uneven_rows": ((7, 3), ("model", None), "float32"),
        "uneven_columns": ((5, 9), (None, "model"), "float32"),
        "both_axes_on_rows": ((10, 3), (("batch", "model"), None), "float32"),
        "transposed": ((6, 5), ("model", "batch"), "float32"),
        "replicated": ((4, 4), (None, None), "float32"),
        "three_dims": ((3, 5, 4), (None, "batch", "model"), "float64"),
        "fewer_rows_than_parts": ((1, 6), ("model", None), "float32"),
        "vector": ((13,), ("batch",), "int64"),
        "scalar": ((), (), "float32"),
        "empty": ((0, 4), (None, "model"), "float32"),
        "bool": ((4, 6), (None, "model"), "bool"),
    }
    results = run_on_ranks(_variable_pieces_body, world_size=4, args=(cases,))
    for rank, result in enumerate(results):
        for name, facts in result.items():
            assert facts["placements"] == facts["expected_placements"], name
            np.testing.assert_array_equal(
                facts["local"], facts["expected_local"], err_msg=name
            )
            np.testing.assert_array_equal(
                facts["global"], facts["full"], err_msg=name
            )


# --------------------------------------------------------------------------
# 4. Assignment keeps the layout
# --------------------------------------------------------------------------


def _dense_model(*, units, input_dim, seed=SEED):
    """A seeded functional model with one Dense layer named "dense"."""
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((input_dim,))
    outputs = keras.layers.Dense(units, name="dense")(inputs)
    return keras.Model(inputs, outputs)


def _sharded_dense_model(world_size, *, seed=SEED):
    """Sets ModelParallel (kernel and bias on "model"); Dense(31) model."""
    distributions.use_model_parallel(
        layout_rules={
            "dense/kernel": (None, "model"),
            "dense/bias": ("model",),
        },
        mesh_shape=(1, world_size),
    )
    model = _dense_model(units=31, input_dim=4, seed=seed)
    return model, model.get_layer("dense")


def _assign_body(rank, world_size, weights_path, new_kernel, new_bias):
    model, layer = _sharded_dense_model(world_size)
    steps = {}
    layer.kernel.assign(new_kernel)
    steps["assign"] = _variable_facts(layer.kernel)
    layer.set_weights([new_kernel * 2, new_bias])
    steps["set_weights"] = _variable_facts(layer.kernel)
    steps["set_weights_bias"] = _variable_facts(layer.bias)
    model.save_weights(weights_path)
    # A differently seeded model, then the saved weights loaded into it.
    restored = _dense_model(units=31, input_dim=4, seed=SEED + 1)
    restored_layer = restored.get_layer("dense")
    steps["fresh"] = _variable_facts(restored_layer.kernel)
    restored.load_weights(weights_path)
    steps["load_weights"] = _variable_facts(restored_layer.kernel)
    steps["load_weights_bias"] = _variable_facts(restored_layer.bias)
    return steps


def _assign_arithmetic_body(rank, world_size, new_kernel):
    _, layer = _sharded_dense_model(world_size)
    steps = {}
    layer.kernel.assign(new_kernel)
    # Outside any layer call: a plain user update of a sharded variable.
    layer.kernel.assign_add(np.ones_like(new_kernel))
    steps["assign_add"] = _variable_facts(layer.kernel)
    layer.kernel.assign_sub(np.full_like(new_kernel, 3.0))
    steps["assign_sub"] = _variable_facts(layer.kernel)
    # A value laid out otherwise (replicated) is written in the kernel's
    # layout: each process copies its own columns.
    value = layer.kernel.value
    replicated = value.redistribute(
        value.device_mesh, [_replicate()] * value.device_mesh.ndim
    )
    layer.kernel.assign(replicated * 2.0)
    steps["assign_replicated"] = _variable_facts(layer.kernel)
    return steps


def _check_assigned_steps(results, expected):
    """Each step kept the sharded layout and holds the expected value."""
    kernel_placements = _placement_strings(_replicate(), _shard(1))
    bias_placements = _placement_strings(_replicate(), _shard(0))
    for rank, steps in enumerate(results):
        for step, value in expected.items():
            placements = (
                bias_placements if "bias" in step else kernel_placements
            )
            assert steps[step]["placements"] == placements, step
            assert (
                steps[step]["local_shape"][-1]
                == (_chunk_sizes(31, parts=2)[rank])
            )
            assert steps[step]["requires_grad"], step
            _assert_close(steps[step]["global"], value)


def _new_weights():
    rng = np.random.RandomState(3)
    return rng.rand(4, 31).astype("float32"), rng.rand(31).astype("float32")


def test_assign_set_weights_and_load_weights_keep_layout(tmp_path):
    new_kernel, new_bias = _new_weights()
    path = str(tmp_path / "model.weights.h5")
    results = run_on_ranks(
        _assign_body, world_size=2, args=(path, new_kernel, new_bias)
    )
    _check_assigned_steps(
        results,
        {
            "assign": new_kernel,
            "set_weights": new_kernel * 2,
            "set_weights_bias": new_bias,
            "load_weights": new_kernel * 2,
            "load_weights_bias": new_bias,
        },
    )
    for steps in results:
        # The fresh model really differed, so loading did something.
        assert not np.allclose(steps["fresh"]["global"], new_kernel * 2)


def test_assign_add_and_assign_sub_keep_layout():
    new_kernel, _ = _new_weights()
    results = run_on_ranks(
        _assign_arithmetic_body, world_size=2, args=(new_kernel,)
    )
    _check_assigned_steps(
        results,
        {
            "assign_add": new_kernel + 1,
            "assign_sub": new_kernel - 2,
            "assign_replicated": (new_kernel - 2) * 2.0,
        },
    )


# --------------------------------------------------------------------------
# 5. Layer outputs
# --------------------------------------------------------------------------


def _pair_layer():
    """A layer whose call returns a tuple of two tensors."""
    import keras

    class PairLayer(keras.layers.Layer):
        def call(self, x):
            return x * 2.0, keras.ops.tanh(x)

    return PairLayer(name="pair")


def _tuple_outputs(x, sequence):
    """Calls Dense, LSTM(return_state) and a tuple-returning layer."""
    import keras

    keras.utils.set_random_seed(SEED)
    dense = keras.layers.Dense(6, name="dense")(x)
    lstm = keras.layers.LSTM(4, return_state=True, name="lstm")(sequence)
    pair = _pair_layer()(dense)
    return {"dense": (dense,), "lstm": tuple(lstm), "pair": tuple(pair)}


def _outputs_body(rank, world_size, x, sequence):
    from keras import ops

    distributions.use_model_parallel(
        layout_rules={
            "dense/output": (None, "model"),
            "lstm/output": (None, "model"),
            "pair/output": (None, "model"),
        },
        mesh_shape=(1, world_size),
    )
    outputs = _tuple_outputs(x, sequence)
    return {
        name: [
            (_placements_of(leaf), ops.convert_to_numpy(leaf))
            for leaf in leaves
        ]
        for name, leaves in outputs.items()
    }


def test_output_layouts_shard_every_leaf():
    x = _inputs((3, 5))
    sequence = _inputs((3, 4, 2), seed=1)
    reference = _reference(_tuple_outputs, x, sequence)
    results = run_on_ranks(_outputs_body, world_size=2, args=(x, sequence))
    sharded = _placement_strings(_replicate(), _shard(1))
    for result in results:
        assert [len(result[k]) for k in ("dense", "lstm", "pair")] == [1, 3, 2]
        for name, leaves in result.items():
            for (placements, value), expected in zip(leaves, reference[name]):
                assert placements == sharded, name
                _assert_close(value, np.asarray(expected.detach()))


def _distribute_tensor_gradient_body(rank, world_size, x):
    import torch

    from keras import distribution as kd
    from keras.src.backend.torch import distribution_lib

    mesh = distributions.use_model_parallel(
        layout_rules={}, mesh_shape=(1, world_size)
    ).device_mesh
    source = torch.tensor(x, requires_grad=True)
    sharded = distribution_lib.distribute_tensor(
        source * 2.0, kd.TensorLayout((None, "model"), mesh)
    )
    loss = (sharded * sharded).sum()
    loss.backward()
    return {
        "placements": _placements_of(sharded),
        "grad": source.grad.numpy(),
        "loss": float(loss.full_tensor()),
    }


def test_gradient_flows_through_distribute_tensor():
    import torch

    x = _inputs((4, 6))
    source = torch.tensor(x, requires_grad=True)
    loss = ((source * 2.0) ** 2).sum()
    loss.backward()
    results = run_on_ranks(
        _distribute_tensor_gradient_body, world_size=2, args=(x,)
    )
    for result in results:
        assert result["placements"] == _placement_strings(
            _replicate(), _shard(1)
        )
        _assert_close(result["grad"], source.grad.numpy())
        _assert_close(result["loss"], loss.item())


def _dense_output_gradients(x):
    """Gradients of sum(dense(x)^2) by a custom-loop style `backward()`."""
    import keras

    keras.utils.set_random_seed(SEED)
    layer = keras.layers.Dense(6, name="dense")
    loss = keras.ops.sum(layer(x) ** 2)
    loss.backward()
    return {
        "kernel": keras.ops.convert_to_numpy(layer.kernel.value.grad),
        "bias": keras.ops.convert_to_numpy(layer.bias.value.grad),
        "loss": float(keras.ops.convert_to_numpy(loss)),
    }


def _layer_output_gradient_body(rank, world_size, x):
    distributions.use_model_parallel(
        layout_rules={
            "dense/kernel": (None, "model"),
            "dense/output": (None, "model"),
        },
        mesh_shape=(1, world_size),
    )
    return _dense_output_gradients(x)


def _mask_set_in_call_body(rank, world_size):
    import torch

    import keras
    from keras.src.backend.common import masking

    class MarkPositive(keras.layers.Layer):
        """Sets its output's mask in `call` (no `compute_mask`)."""

        def call(self, x):
            outputs = x * 2.0
            masking.set_keras_mask(outputs, keras.ops.sum(x, axis=-1) > 0)
            return outputs

    # Nothing sharded: outputs are replicated over "model".
    distributions.use_model_parallel(
        layout_rules={}, mesh_shape=(1, world_size)
    )
    dense = keras.layers.Dense(4, name="dense", kernel_initializer="ones")
    x = np.array([[1.0, 1.0], [-1.0, -1.0]], dtype="float32")
    with torch.enable_grad():
        # Replicated over "model" and requiring a gradient: the output is
        # wrapped to reduce partial-sum gradients in the backward pass.
        outputs = MarkPositive()(dense(x))
    mask = masking.get_keras_mask(outputs)
    return (
        None if mask is None else np.asarray(keras.ops.convert_to_numpy(mask))
    )


def test_mask_set_inside_a_layer_call_survives_the_layer_boundary():
    for mask in run_on_ranks(_mask_set_in_call_body, world_size=2):
        np.testing.assert_array_equal(mask, [True, False])


def test_gradient_through_sharded_layer_output_matches_single_process():
    x = _inputs((3, 4))
    reference = _reference(_dense_output_gradients, x)
    results = run_on_ranks(_layer_output_gradient_body, world_size=2, args=(x,))
    for result in results:
        for name in ("kernel", "bias", "loss"):
            _assert_close(result[name], reference[name])


# --------------------------------------------------------------------------
# 6. Data inputs
# --------------------------------------------------------------------------


def _data_input_body(rank, world_size, part_sizes, global_batch_size):
    import torch

    from keras import distribution as kd
    from keras.src.backend.torch import distribution_lib

    mesh = distributions.device_mesh((world_size,))
    total = sum(part_sizes)
    rows = np.arange(total * 3, dtype=np.float32).reshape(total, 3)
    start = sum(part_sizes[:rank])
    part = rows[start : start + part_sizes[rank]]
    layout = kd.TensorLayout(("batch", None), mesh)
    try:
        batch = distribution_lib.distribute_data_input(
            part, layout, "batch", global_batch_size=global_batch_size
        )
    except ValueError as error:
        return {"error": str(error)}
    return {
        "shape": tuple(batch.shape),
        "placements": _placements_of(batch),
        "local": _local_numpy(batch),
        "global": batch.full_tensor().numpy(),
        "is_dtensor": _placements_of(batch) is not None,
        "dtype": str(batch.dtype),
        "torch_local": torch.is_tensor(batch.to_local()),
    }


@pytest.mark.parametrize(
    "world_size,part_sizes,global_batch_size",
    [
        (2, [2, 2], None),
        (2, [2, 2], 4),
        (2, [4, 3], None),
        (2, [4, 3], 7),
        (4, [2, 2, 1, 0], None),
        (4, [2, 2, 1, 0], 5),
        (4, [3, 3, 3, 3], None),
    ],
)
def test_distribute_data_input_builds_the_global_batch(
    world_size, part_sizes, global_batch_size
):
    results = run_on_ranks(
        _data_input_body,
        world_size=world_size,
        args=(part_sizes, global_batch_size),
    )
    total = sum(part_sizes)
    rows = np.arange(total * 3, dtype=np.float32).reshape(total, 3)
    # A batch leaving a process without rows is gathered whole on each.
    empty = 0 in part_sizes
    for rank, result in enumerate(results):
        assert "error" not in result, result.get("error")
        assert result["shape"] == (total, 3)
        expected = _replicate() if empty else _shard(0)
        assert result["placements"] == _placement_strings(expected)
        local_rows = total if empty else part_sizes[rank]
        assert result["local"].shape == (local_rows, 3)
        np.testing.assert_array_equal(result["global"], rows)


def test_distribute_data_input_rejects_mismatched_parts():
    results = run_on_ranks(
        _data_input_body,
        world_size=2,
        kwargs={"part_sizes": [2, 4], "global_batch_size": None},
    )
    for result in results:
        assert "error" in result, "mismatched part sizes were accepted"
        assert "[2, 4]" in result["error"]


def _data_input_2x2_body(rank, world_size):
    from keras import distribution as kd
    from keras.src.backend.torch import distribution_lib

    mesh = distributions.device_mesh((2, 2))
    batch_index = mesh.backend_mesh.get_coordinate()[0]
    rows = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)
    # Ranks along "model" hold the same part: the one of their batch index.
    part = np.split(rows, 2)[batch_index]
    batch = distribution_lib.distribute_data_input(
        part, kd.TensorLayout(("batch", None), mesh), "batch"
    )
    return {
        "shape": tuple(batch.shape),
        "placements": _placements_of(batch),
        "local": _local_numpy(batch),
        "global": batch.full_tensor().numpy(),
    }


def test_distribute_data_input_on_2x2_mesh():
    results = run_on_ranks(_data_input_2x2_body, world_size=4)
    rows = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)
    for rank, result in enumerate(results):
        assert result["shape"] == (4, 3)
        assert result["placements"] == _placement_strings(
            _shard(0), _replicate()
        )
        np.testing.assert_array_equal(
            result["local"], np.split(rows, 2)[rank // 2]
        )
        np.testing.assert_array_equal(result["global"], rows)


# --------------------------------------------------------------------------
# 7. Collectives
# --------------------------------------------------------------------------


def _own_value(rank):
    """A per-rank value whose reductions all differ."""
    return np.array(
        [rank + 1.0, (-1.0) ** rank * 10 * (rank + 1)], dtype=np.float32
    )


def _own_part(rank, *, rows):
    """A per-rank (rows, 2) block with rank-specific values."""
    return (
        np.full((rows, 2), rank, dtype=np.float32)
        + np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) / 10
    )


def _own_cols(rank):
    """A per-rank (2, n) block, n differing between batch indices."""
    return np.tile(_own_part(rank, rows=2), (1, rank // 2 + 1))


def _collectives_body(rank, world_size):
    import torch

    from keras import distribution as kd
    from keras.src.backend.torch import distribution_lib as dl

    mesh = distributions.use_model_parallel(
        layout_rules={"dense/kernel": ("batch", "model")}, mesh_shape=(2, 2)
    ).device_mesh
    own = torch.tensor(_own_value(rank))
    reduced = {
        (op, axis): dl.all_reduce(own, op=op, axis_name=axis).numpy()
        for op in ("sum", "mean", "max", "min")
        for axis in ("model", "batch")
    }
    # Unequal sizes along the gathered axis.
    rows_part = torch.tensor(_own_part(rank, rows=rank % 2 + 1))
    cols_part = torch.tensor(_own_cols(rank))
    gathered = {
        "rows_model": dl.all_gather(rows_part, axis=0, axis_name="model"),
        "cols_batch": dl.all_gather(cols_part, axis=-1, axis_name="batch"),
    }
    sharded_input = dl.distribute_tensor(
        torch.arange(8, dtype=torch.float32).reshape(4, 2),
        kd.TensorLayout(("batch", None), mesh),
    )
    layer = _dense_weights(units=6, input_dim=4)
    full_kernel = dl.all_gather_variable(layer.kernel)
    return {
        "reduced": reduced,
        "gathered": {k: v.numpy() for k, v in gathered.items()},
        "dtensor_sum": dl.all_reduce(sharded_input, "sum", "batch").numpy(),
        "full_kernel": full_kernel.detach().numpy(),
        "full_kernel_type": type(full_kernel).__name__,
        "kernel_placements": _placements_of(layer.kernel.value),
        "keras_seed_kernel": np.asarray(layer.kernel),
    }


def test_collectives_follow_mesh_axis_groups():
    results = run_on_ranks(_collectives_body, world_size=4)
    mesh = np.arange(4).reshape(2, 2)
    groups = {
        "model": lambda r: list(mesh[r // 2, :]),
        "batch": lambda r: list(mesh[:, r % 2]),
    }
    reducers = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}
    reference_kernel = np.asarray(
        _reference(_dense_weights, units=6, input_dim=4).kernel
    )
    for rank, result in enumerate(results):
        for (op, axis), value in result["reduced"].items():
            members = np.stack([_own_value(r) for r in groups[axis](rank)])
            _assert_close(value, reducers[op](members, axis=0))
        rows = np.concatenate(
            [_own_part(r, rows=r % 2 + 1) for r in groups["model"](rank)],
            axis=0,
        )
        np.testing.assert_array_equal(result["gathered"]["rows_model"], rows)
        cols = np.concatenate(
            [_own_cols(r) for r in groups["batch"](rank)], axis=-1
        )
        np.testing.assert_array_equal(result["gathered"]["cols_batch"], cols)
        value = np.arange(8, dtype=np.float32).reshape(4, 2)
        np.testing.assert_array_equal(
            result["dtensor_sum"], value[:2] + value[2:]
        )
        assert result["kernel_placements"] == _placement_strings(
            _shard(0), _shard(1)
        )
        assert result["full_kernel_type"] == "Tensor"
        _assert_close(result["full_kernel"], reference_kernel)
        _assert_close(result["keras_seed_kernel"], reference_kernel)


# --------------------------------------------------------------------------
# 9. Mixed plain tensors and DTensors
# --------------------------------------------------------------------------


def _mixed_model():
    """A small model of Embedding, LayerNorm, MHA, Dropout, Conv2D, Dense."""
    import keras

    keras.utils.set_random_seed(SEED)
    tokens = keras.Input((5,), dtype="int32")
    image = keras.Input((6, 6, 2))
    h = keras.layers.Embedding(20, 8)(tokens)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(h, h)
    h = keras.layers.Dropout(0.3, seed=11)(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    h = keras.layers.Dense(8)(h)
    c = keras.layers.Conv2D(4, 3)(image)
    c = keras.layers.GlobalAveragePooling2D()(c)
    c = keras.layers.Dense(8)(c)
    outputs = keras.layers.Dense(3)(keras.layers.Add()([h, c]))
    return keras.Model([tokens, image], outputs)


def _mixed_inputs():
    rng = np.random.RandomState(0)
    return [
        rng.randint(0, 20, size=(4, 5)).astype("int32"),
        rng.rand(4, 6, 6, 2).astype("float32"),
    ]


def _mixed_outputs():
    """Inference and training-mode outputs of the seeded mixed model."""
    from keras import ops

    model = _mixed_model()
    inputs = _mixed_inputs()
    return {
        "inference": ops.convert_to_numpy(model(inputs, training=False)),
        "training": ops.convert_to_numpy(model(inputs, training=True)),
        "paths": [v.path for v in model.variables],
        "sharded": sorted(
            v.path
            for v in model.variables
            if _is_sharded(_placements_of(v.value))
        ),
    }


_MIXED_LAYOUTS = {
    "embedding/embeddings": (None, "model"),
    "dense.*/kernel": (None, "model"),
    "multi_head_attention/(query|key|value)/kernel": (None, "model", None),
    "multi_head_attention/attention_output/kernel": ("model", None, None),
}


def _mixed_model_body(rank, world_size):
    distributions.use_model_parallel(
        layout_rules=_MIXED_LAYOUTS, mesh_shape=(1, world_size)
    )
    return _mixed_outputs()


def test_mixed_model_on_plain_inputs_matches_single_process():
    reference = _reference(_mixed_outputs)
    # Its dropout draws by position under a distribution: the training
    # call's reference is one process under the same distribution.
    (one_process,) = run_on_ranks(_mixed_model_body, world_size=1)
    _assert_close(one_process["inference"], reference["inference"])
    results = run_on_ranks(_mixed_model_body, world_size=2)
    expected_sharded = sorted(
        path
        for path in reference["paths"]
        if any(re.fullmatch(key, path) for key in _MIXED_LAYOUTS)
    )
    assert len(expected_sharded) == 8
    for result in results:
        assert result["paths"] == reference["paths"]
        # Every variable the LayoutMap names is sharded: the model really
        # mixes sharded DTensors with plain inputs and constants.
        assert result["sharded"] == expected_sharded
        _assert_close(result["inference"], reference["inference"])
        _assert_close(result["training"], one_process["training"])


def _outside_layers_outputs():
    """A layer's output stacked with plain zeros outside any layer call,
    as keras-hub's `generate` stacks the caches its layers return with the
    zeros it made for layers that left theirs untouched."""
    import torch

    import keras
    from keras import ops

    keras.utils.set_random_seed(SEED)
    layer = keras.layers.Dense(4, name="dense")
    y = layer(_inputs((3, 5)))
    stacked = torch.stack([y, torch.zeros(3, 4)], dim=1)
    return {
        "stacked": ops.convert_to_numpy(stacked),
        "output_placements": _placements_of(y),
    }


def _outside_layers_body(rank, world_size):
    import warnings

    import torch

    import keras

    distributions.use_model_parallel(
        layout_rules={"dense/kernel": (None, "model")},
        mesh_shape=(1, world_size),
    )
    result = _outside_layers_outputs()
    y = keras.layers.Dense(4, name="dense")(_inputs((3, 5)))
    with warnings.catch_warnings(record=True) as caught:
        # A plain tensor of one element: DTensor's warning is silenced.
        y * torch.ones(1)
    result["warnings"] = [str(w.message) for w in caught]
    keras.distribution.set_distribution(None)
    # Without a distribution, torch's own rule holds again.
    try:
        torch.stack([y, torch.zeros(3, 4)], dim=1)
        result["after_unset"] = "computed"
    except RuntimeError as e:
        result["after_unset"] = str(e)
    return result


def test_plain_tensors_outside_layer_calls_are_replicated_values():
    reference = _reference(_outside_layers_outputs)
    for result in run_on_ranks(_outside_layers_body, world_size=2):
        # The layer's output is a DTensor sharded over "model".
        assert _is_sharded(result["output_placements"])
        _assert_close(result["stacked"], reference["stacked"])
        assert "mixed torch.Tensor and DTensor" in result["after_unset"]
        assert result["warnings"] == []


def _loop_steps(distribute):
    """Steps of a `while_loop` whose condition reduces a sharded batch: it
    runs while any row still has an entry above the step count (rows end
    at different steps, as keras-hub's prompts reach their stop token)."""
    import torch

    from keras import ops

    x = distribute(torch.tensor([[1.0], [2.0], [5.0], [3.0]]))

    def cond(x, step):
        return ops.any(x > ops.cast(step, x.dtype))

    def body(x, step):
        return x, step + 1

    _, steps = ops.while_loop(cond, body, (x, 0))
    return int(steps)


def _loop_body(rank, world_size):
    from keras import distribution as kd

    distributions.use_data_parallel()
    distribution = kd.distribution()
    return _loop_steps(
        lambda x: kd.distribute_tensor(
            x, distribution.get_data_layout(tuple(x.shape))
        )
    )


def test_a_loop_condition_over_a_sharded_batch_is_read_whole():
    expected = _loop_steps(lambda x: x)
    assert expected == 5
    # The second process' rows (5 and 3) alone would stop at 5 steps, the
    # first's (1 and 2) at 2.
    assert run_on_ranks(_loop_body, world_size=2) == [expected, expected]


def _conv_outputs(x, use_bias):
    import keras
    from keras import ops

    keras.utils.set_random_seed(SEED)
    layer = keras.layers.Conv2D(4, 3, use_bias=use_bias, name="conv2d")
    output = layer(x)
    return {
        "output": ops.convert_to_numpy(output),
        "placements": _placements_of(layer.kernel.value),
    }


def _sharded_conv_body(rank, world_size, x, use_bias):
    # Output channels sharded, as a JAX user would shard a conv kernel.
    distributions.use_model_parallel(
        layout_rules={"conv2d/kernel": (None, None, None, "model")},
        mesh_shape=(1, world_size),
    )
    return _conv_outputs(x, use_bias)


@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "no-bias"])
def test_conv2d_with_sharded_kernel_matches_single_process(use_bias):
    x = _inputs((2, 6, 6, 2))
    reference = _reference(_conv_outputs, x, use_bias)
    results = run_on_ranks(_sharded_conv_body, world_size=2, args=(x, use_bias))
    for result in results:
        assert result["placements"] == _placement_strings(
            _replicate(), _shard(3)
        )
        assert result["output"].shape == reference["output"].shape
        _assert_close(result["output"], reference["output"])


def _check_replication_body(rank, world_size, differ):
    import keras
    from keras.src.backend.torch.distributed.training import layer_call

    os.environ[layer_call.CHECK_REPLICATION_ENV] = "1"
    distributions.use_data_parallel()
    layer = _dense_weights(units=3, input_dim=4)
    x = _inputs((2, 4)) + (rank if differ else 0)
    try:
        output = layer(x)
    except ValueError as error:
        return {"error": str(error)}
    return {"output": keras.ops.convert_to_numpy(output)}


def test_check_replication_rejects_differing_plain_inputs():
    results = run_on_ranks(
        _check_replication_body, world_size=2, kwargs={"differ": True}
    )
    for result in results:
        assert "error" in result, "differing plain inputs were accepted"
        assert "layer call input" in result["error"]
        assert "processes [1]" in result["error"]
        assert "(2, 4)" in result["error"]


def test_check_replication_accepts_identical_plain_inputs():
    layer = _reference(_dense_weights, units=3, input_dim=4)
    expected = np.asarray(layer(_inputs((2, 4))).detach())
    results = run_on_ranks(
        _check_replication_body, world_size=2, kwargs={"differ": False}
    )
    for result in results:
        assert "error" not in result, result.get("error")
        _assert_close(result["output"], expected)


# --------------------------------------------------------------------------
# 10. Threads
# --------------------------------------------------------------------------


def _thread_body(rank, world_size):
    import threading

    import keras
    from keras import distribution as kd
    from keras.src.backend.torch import distribution_lib

    distribution = distributions.use_data_parallel()
    seen = {}

    def work():
        # Keras' own global state is thread-local: not set in this thread.
        seen["keras_distribution"] = kd.distribution() is distribution
        seen["current"] = distribution_lib.current_distribution() is (
            distribution
        )
        layer = keras.layers.Dense(3)
        x = _inputs((2, 4))
        output = layer(x)
        seen["placements"] = _placements_of(layer.kernel.value)
        seen["output"] = keras.ops.convert_to_numpy(output)
        seen["expected"] = x @ np.asarray(layer.kernel) + np.asarray(layer.bias)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return seen


def test_distribution_is_visible_in_new_threads():
    results = run_on_ranks(_thread_body, world_size=2)
    for result in results:
        assert result["current"]
        assert result["placements"] == _placement_strings(_replicate())
        _assert_close(result["output"], result["expected"])
        _assert_close(result["output"], results[0]["output"])


# --------------------------------------------------------------------------
# 11. Variable paths of wrapped torch modules
# --------------------------------------------------------------------------


def _wrapper_model():
    """Functional model: TorchModuleWrapper(Linear(8, 6)) then Dense(3)."""
    import torch

    import keras

    keras.utils.set_random_seed(SEED)  # Also seeds torch's Linear init.
    inputs = keras.Input((8,))
    wrapper = keras.layers.TorchModuleWrapper(
        torch.nn.Sequential(torch.nn.Linear(8, 6)),
        name="wrapper",
        output_shape=(None, 6),
    )
    outputs = keras.layers.Dense(3, name="dense")(wrapper(inputs))
    return keras.Model(inputs, outputs), wrapper


def _wrapper_outputs(x):
    from keras import ops

    model, wrapper = _wrapper_model()
    linear = wrapper.module[0]
    variables = {v.path: v for v in model.variables}
    return {
        "paths": sorted(variables),
        "placements": {
            p: _placements_of(v.value) for p, v in variables.items()
        },
        "module_uses_variable": linear.weight
        is (variables["wrapper/0.weight"].value),
        "output": ops.convert_to_numpy(model(x)),
    }


def _wrapper_body(rank, world_size, x):
    distributions.use_model_parallel(
        layout_rules={
            r".*0\.weight": ("model", None),
            "dense.kernel": (None, "model"),
        },
        mesh_shape=(1, world_size),
    )
    return _wrapper_outputs(x)


def test_torch_module_wrapper_paths_and_layouts():
    x = _inputs((3, 8))
    reference = _reference(_wrapper_outputs, x)
    results = run_on_ranks(_wrapper_body, world_size=2, args=(x,))
    paths = ["dense/bias", "dense/kernel", "wrapper/0.bias", "wrapper/0.weight"]
    assert reference["paths"] == paths
    for result in results:
        assert result["paths"] == paths
        placements = result["placements"]
        assert placements["wrapper/0.weight"] == _placement_strings(
            _replicate(), _shard(0)
        )
        assert placements["dense/kernel"] == _placement_strings(
            _replicate(), _shard(1)
        )
        assert placements["wrapper/0.bias"] == _placement_strings(
            _replicate(), _replicate()
        )
        assert result["module_uses_variable"]
        _assert_close(result["output"], reference["output"])


# --------------------------------------------------------------------------
# 12. Debug logging
# --------------------------------------------------------------------------


class _RecordingHandler(logging.Handler):
    """Keeps the formatted messages of the records it receives."""

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _collective_count(fn):
    """Number of collectives `fn()` issues, and its result."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        result = fn()
    return comm.get_total_counts(), result


def _logging_body(rank, world_size, axis_name):
    logger = logging.getLogger("keras.distribution")
    handler = _RecordingHandler()
    old_level = logger.level
    logger.addHandler(handler)
    try:
        logger.setLevel(logging.DEBUG)
        distributions.use_model_parallel(
            layout_rules={"dense/kernel": (None, axis_name)},
            mesh_shape=(1, world_size),
            axis_names=("batch", axis_name),
        )
        debug_count, layer = _collective_count(
            lambda: _dense_weights(units=5, input_dim=3)
        )
        log_count, _ = _collective_count(
            lambda: logger.debug("kernel %s", layer.kernel.value)
        )
        distributions.use_model_parallel(
            layout_rules={"dense/kernel": (None, "model")},
            mesh_shape=(1, world_size),
        )
        logger.setLevel(logging.WARNING)
        unlogged_count, _ = _collective_count(
            lambda: _dense_weights(units=5, input_dim=3)
        )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    variables = {
        v.path: (
            str(tuple(v.value.placements)),
            str(tuple(v.value.to_local().shape)),
        )
        for v in layer.variables
    }
    return {
        "messages": handler.messages,
        "variables": variables,
        "counts": (debug_count, unlogged_count, log_count),
    }


def test_debug_logging_records_mesh_and_variables_without_collectives():
    # A fresh axis name: the torch mesh is cached, and logged when created.
    axis_name = "model_" + uuid.uuid4().hex[:8]
    results = run_on_ranks(_logging_body, world_size=2, args=(axis_name,))
    for result in results:
        messages = result["messages"]
        mesh_lines = [m for m in messages if "mesh" in m and axis_name in m]
        assert mesh_lines, messages
        for path, (placements, local_shape) in result["variables"].items():
            lines = [m for m in messages if path in m]
            assert lines, (path, messages)
            assert placements in lines[0] and local_shape in lines[0], lines
        debug_count, unlogged_count, log_count = result["counts"]
        # Logging adds no collective to creating variables, nor to
        # formatting a DTensor.
        assert debug_count == unlogged_count > 0
        assert log_count == 0


# A user's script, run as its own process: it sets its distribution with
# the public API, not with the tests' helpers.
_DEBUG_SCRIPT = """
import keras
from keras import distribution

distribution.set_distribution(distribution.DataParallel())
layer = keras.layers.Dense(2, name="dense")
layer.build((None, 3))
print("placements", layer.kernel.value.placements)
"""


def test_debug_env_var_prefixes_log_lines_with_rank():
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
    }
    env.update(
        KERAS_BACKEND="torch",
        KERAS_DISTRIBUTION_DEBUG="1",
        PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
    )
    result = subprocess.run(
        [sys.executable, "-c", _DEBUG_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [
        line
        for line in result.stderr.splitlines()
        if "keras.distribution" in line
    ]
    assert lines, result.stderr[-3000:]
    assert all(line.startswith("[rank 0] ") for line in lines), lines
    assert any("mesh" in line for line in lines), lines
    assert any("dense/kernel" in line for line in lines), lines
    assert "Replicate()" in result.stdout


# --------------------------------------------------------------------------
# 13. Sharding summary
# --------------------------------------------------------------------------


def _summary_model():
    import keras

    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(31, name="dense")(inputs)
    outputs = keras.layers.Dense(2, name="head")(hidden)
    return keras.Model(inputs, outputs)


def _summary_body(rank, world_size):
    from keras import distribution as kd
    from keras.src.backend.torch.distributed.dtensor_gaps import fallback

    # The worker may have run other tests' fallbacks, which the summary
    # would list after its total.
    fallback.reset_fallback_counts()
    distributions.use_model_parallel(
        layout_rules={
            "dense/kernel": (None, "model"),
            "dense/bias": ("model",),
        },
        mesh_shape=(1, world_size),
    )
    model = _summary_model()
    printed = []
    rows = kd.sharding_summary(model, print_fn=printed.append)
    actual = {}
    for variable in model.variables:
        value = variable.value
        local = value.to_local()
        actual[variable.path] = {
            "path": variable.path,
            "dtype": str(variable.dtype),
            "global_shape": tuple(value.shape),
            "placements": tuple(str(p) for p in value.placements),
            "local_shape": tuple(local.shape),
            "local_bytes": local.numel() * local.element_size(),
            # The rule that matched it; none matches the head.
            "layout_rule": variable.path if "dense" in variable.path else None,
        }
    return {
        "rows": rows,
        "actual": actual,
        "printed": printed,
        "info": kd.mesh_info(),
    }


def test_sharding_summary_matches_the_dtensors():
    results = run_on_ranks(_summary_body, world_size=2)
    for rank, result in enumerate(results):
        rows = {row["path"]: row for row in result["rows"]}
        assert list(rows) == list(result["actual"])
        assert rows == result["actual"]
        units = _chunk_sizes(31, parts=2)[rank]
        assert rows["dense/kernel"]["local_shape"] == (4, units)
        assert rows["dense/kernel"]["global_shape"] == (4, 31)
        assert rows["dense/kernel"]["local_bytes"] == 4 * units * 4
        assert rows["head/kernel"]["placements"] == _placement_strings(
            _replicate(), _replicate()
        )
        assert len(result["printed"]) == 1
        lines = result["printed"][0].splitlines()
        assert all(line.startswith(f"[rank {rank}]") for line in lines)
        for path in rows:
            assert sum(f" {path} " in line for line in lines) == 1, path
        total = sum(row["local_bytes"] for row in result["rows"])
        assert str(total) in lines[-1] and "total" in lines[-1]
        assert len(lines) == len(rows) + 2  # Header, rows, total.
        assert result["info"] == {
            "shape": (1, 2),
            "axis_names": ("batch", "model"),
            "devices": [["cpu:0", "cpu:1"]],
            "process_id": rank,
            "num_processes": 2,
            "coordinate": (0, rank),
        }


# --------------------------------------------------------------------------
# 14. A single process (in the pytest process)
# --------------------------------------------------------------------------


@pytest.fixture
def single_process_keras():
    """Keras in this process; undoes the distribution and process group."""
    import torch.distributed as dist

    import keras
    from keras import distribution as kd

    had_group = dist.is_initialized()
    keras.backend.clear_session()
    yield keras
    kd.set_distribution(None)
    keras.backend.clear_session()
    if not had_group and dist.is_initialized():
        from keras.src.backend.torch.distributed.core import layouts

        # The cached torch meshes use this group's subgroups: drop them
        # with it, so a later group never meets a stale mesh.
        layouts._torch_meshes.clear()
        dist.destroy_process_group()


def _fit_small_model(keras):
    """Fits a tiny seeded model for 2 epochs; returns (model, history)."""
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = _inputs((8, 4)), _inputs((8, 2), seed=1)
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    return model, history


def test_single_process_data_parallel(single_process_keras):
    keras = single_process_keras
    from keras import distribution as kd

    reference_model, reference_history = _fit_small_model(keras)
    reference_weights = [np.asarray(w) for w in reference_model.weights]
    keras.backend.clear_session()

    assert kd.list_devices() == ["cpu:0"]
    distribution = distributions.use_data_parallel()
    assert distribution.device_mesh.devices.tolist() == ["cpu:0"]
    model, history = _fit_small_model(keras)
    for variable in model.weights:
        assert _placements_of(variable.value) == _placement_strings(
            _replicate()
        ), variable.path
    for weight, expected in zip(model.weights, reference_weights):
        _assert_close(np.asarray(weight), expected)
    _assert_close(history.history["loss"], reference_history.history["loss"])
