"""Invalid distribution configurations raise clear errors, without hanging.

The matrix of wrong configurations: each must end on every process within
its bound with a `ValueError` that says what was received (processes that
disagree too: a different model, a different number of batches). Failures
of a running job (a peer that freezes, dies or raises) are in
`tests/test_job_failures.py`.

Each case runs in its own multi-rank body: the body makes the mistake,
catches the `ValueError` and returns its message, then joins a barrier --
which only returns if every rank got past the mistake (no rank is stuck in
a collective the others never entered). The tests check that the message
names what was received.
"""

import numpy as np
import pytest

from tests import distributions
from tests.harness import run_on_ranks

# Short enough to catch a hang quickly; generous for a loaded machine.
HANG_TIMEOUT = 120


def _layout(axes, world_size):
    """A TensorLayout on the (1, world_size) ("batch", "model") mesh."""
    from keras import distribution as kd

    return kd.TensorLayout(axes, distributions.device_mesh((1, world_size)))


def _build_dense_under(layout_rules, world_size):
    """Sets a ModelParallel distribution and builds Dense(4) on 3 features."""
    import keras

    distributions.use_model_parallel(
        layout_rules=layout_rules, mesh_shape=(1, world_size)
    )
    layer = keras.layers.Dense(4, name="dense")
    layer.build((None, 3))


def _initialize(**kwargs):
    from keras import distribution as kd

    kd.initialize(**kwargs)


def _all_reduce(**kwargs):
    import torch

    from keras.src.backend.torch import distribution_lib

    distributions.use_data_parallel()
    distribution_lib.all_reduce(torch.ones(2), **kwargs)


def _build_different_models(rank):
    import keras

    distributions.use_data_parallel()
    units = 16 if rank == 0 else 32
    keras.Sequential([keras.Input((8,)), keras.layers.Dense(units)])


def _fit_own_data(num_samples):
    """Each process fits on its own data (`auto_shard_dataset=False`)."""
    import keras

    distributions.use_data_parallel(auto_shard_dataset=False)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((num_samples, 8), "float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)


def _fit_own_generator():
    """Each process fits on its own generator, of unknown length."""
    import keras

    distributions.use_data_parallel(auto_shard_dataset=False)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((8, 8), "float32")
    batches = ((x, x[:, :1]) for _ in range(3))
    model.fit(batches, epochs=1, verbose=0)


def _fit_global_data(num_samples):
    """Each process fits on what should be the same global data."""
    import keras

    distributions.use_data_parallel()
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((num_samples, 8), "float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)


def _model_parallel_with_batch_axis(batch_dim_name, axis_names, world_size):
    from keras import distribution as kd

    mesh = distributions.device_mesh((1, world_size), axis_names=axis_names)
    kd.ModelParallel(
        layout_map=kd.LayoutMap(mesh), batch_dim_name=batch_dim_name
    )


def _use_data_parallel_on(devices):
    """Sets DataParallel over `devices` and creates a variable under it.

    The mesh is checked where it is first used, not when it is set.
    """
    import keras

    distributions.use_data_parallel(devices=devices)
    keras.Variable(np.ones(2))


def _make_mistake(case, rank, world_size):
    """Makes the mistake named `case`; returns normally if none was raised."""
    if case == "mesh_with_3_devices":
        _use_data_parallel_on(["cpu:0", "cpu:1", "cpu:2"])
    elif case == "unknown_device_type":
        _use_data_parallel_on(["tpu:0", "cpu:1"])
    elif case == "unknown_device_index":
        _use_data_parallel_on(["cpu:0", "cpu:9"])
    elif case == "unknown_axis_in_layout":
        _layout(("batch", "nope"), world_size)
    elif case == "unknown_axis_in_layout_map":
        _build_dense_under({"dense/kernel": (None, "nope")}, world_size)
    elif case == "axis_used_twice":
        _layout(("model", "model"), world_size).backend_layout
    elif case == "axis_used_twice_in_layout_map":
        _build_dense_under({"dense/kernel": ("model", "model")}, world_size)
    elif case == "layout_rank_mismatch":
        _build_dense_under({"dense/kernel": ("model", None, None)}, world_size)
    elif case == "multi_axis_not_in_mesh_order":
        _layout((("model", "batch"), None), world_size).backend_layout
    elif case == "initialize_num_processes":
        _initialize(num_processes=world_size + 1)
    elif case == "initialize_process_id":
        _initialize(process_id=(rank + 1) % world_size)
    elif case == "all_reduce_unknown_op":
        _all_reduce(op="prod", axis_name="batch")
    elif case == "all_reduce_unknown_axis":
        _all_reduce(op="sum", axis_name="nope")
    elif case == "different_models":
        _build_different_models(rank)
    elif case == "different_batch_counts":
        _fit_own_data(num_samples=32 if rank == 0 else 48)
    elif case == "unknown_batch_counts":
        _fit_own_generator()
    elif case == "different_global_batch_counts":
        _fit_global_data(num_samples=32 if rank == 0 else 48)
    elif case == "gpu_devices_on_cpu":
        _use_data_parallel_on(["gpu:0", "gpu:1"])
    elif case == "batch_dim_name_not_in_mesh":
        _model_parallel_with_batch_axis("batch", ("data", "model"), world_size)
    else:
        raise AssertionError(f"unknown case {case}")


def _mistake_body(rank, world_size, case):
    import torch.distributed as dist

    try:
        _make_mistake(case, rank, world_size)
        message = None
    except ValueError as error:
        message = str(error)
    # Every rank must get here: nobody waits in a collective.
    dist.barrier()
    return message


# case -> substrings the message must contain ({rank}, {other} filled in).
_CASES = {
    "mesh_with_3_devices": ["cpu:2", "3 devices", "2 process"],
    "unknown_device_type": ["tpu:0"],
    "unknown_device_index": ["cpu:9"],
    "unknown_axis_in_layout": ["nope"],
    "unknown_axis_in_layout_map": ["nope"],
    "axis_used_twice": ["'model'", "more than once"],
    "axis_used_twice_in_layout_map": ["'model'", "more than once"],
    "layout_rank_mismatch": ["dense/kernel", "3 axes", "rank 2"],
    "multi_axis_not_in_mesh_order": ["('model', 'batch')", "mesh order"],
    "initialize_num_processes": ["num_processes", "3", "WORLD_SIZE=2"],
    "initialize_process_id": ["process_id", "{other}", "RANK={rank}"],
    "all_reduce_unknown_op": ["prod"],
    "all_reduce_unknown_axis": ["nope"],
    "different_models": [
        "build different models",
        "'sequential/dense/kernel' (shape (8, 16), dtype torch.float32)",
        "'sequential/dense/kernel' (shape (8, 32), dtype torch.float32)",
    ],
    "different_batch_counts": [
        "process 0: 4, process 1: 6",
        "steps_per_epoch",
    ],
    "unknown_batch_counts": ["auto_shard_dataset=False", "steps_per_epoch"],
    "different_global_batch_counts": [
        "process 0: 4, process 1: 6",
        "the same global data",
    ],
    "gpu_devices_on_cpu": ["['gpu:0', 'gpu:1']", "no GPU", "list_devices"],
    "batch_dim_name_not_in_mesh": [
        "batch_dim_name='batch'",
        "['data', 'model']",
    ],
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_invalid_configuration_raises_a_clear_value_error(case):
    messages = run_on_ranks(
        _mistake_body, world_size=2, args=(case,), timeout=HANG_TIMEOUT
    )
    for rank, message in enumerate(messages):
        assert message is not None, f"{case}: no ValueError on rank {rank}"
        for expected in _CASES[case]:
            expected = expected.format(rank=rank, other=(rank + 1) % 2)
            assert expected in message, (case, expected, message)


def _seeded_on_one_body(rank, world_size):
    import keras
    from keras import distribution as kd
    from keras.src.backend.common import global_state
    from keras.src.utils import rng_utils

    # Process 0 seeds; process 1 does not.
    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, None)
    if rank == 0:
        keras.utils.set_random_seed(3)
    kd.initialize()
    return rng_utils.get_random_seed()


def test_initialize_gives_a_process_without_a_seed_process_0s():
    assert run_on_ranks(
        _seeded_on_one_body, world_size=2, timeout=HANG_TIMEOUT
    ) == [3, 3]


def _collective_choice_on_one_body(rank, world_size):
    import os

    from keras import distribution as kd

    # Process 1 alone would not gather FSDP weights.
    if rank == 1:
        os.environ["KERAS_DISTRIBUTION_GATHER_WEIGHTS"] = "off"
    os.environ["KERAS_DISTRIBUTION_DEBUG"] = str(rank)  # May differ.
    try:
        kd.initialize()
    except ValueError as e:
        return str(e)
    return None


def test_initialize_refuses_collective_choices_that_differ():
    messages = run_on_ranks(
        _collective_choice_on_one_body, world_size=2, timeout=HANG_TIMEOUT
    )
    for message in messages:
        assert message is not None, messages
        assert "'KERAS_DISTRIBUTION_GATHER_WEIGHTS': ['<unset>', 'off']" in (
            message
        ), message
        assert "DEBUG" not in message, message


def _valid_initialize_body(rank, world_size):
    from keras import distribution as kd

    # Agreeing arguments are accepted: initialize() is idempotent.
    kd.initialize(num_processes=world_size, process_id=rank)
    kd.initialize()
    return kd.list_devices()


def test_initialize_with_agreeing_arguments_is_idempotent():
    for devices in run_on_ranks(
        _valid_initialize_body, world_size=2, timeout=HANG_TIMEOUT
    ):
        assert devices == [f"cpu:{i}" for i in range(2)]
        assert np.unique(devices).size == 2


# --------------------------------------------------------------------------
# A mesh that does not match the job is refused where it is first used.
# --------------------------------------------------------------------------


def _first_use(use, distribution):
    """Uses the current distribution's mesh for the first time."""
    import torch

    import keras
    from keras import distribution as kd
    from keras.src.backend.torch import distribution_lib

    if use == "variable":
        keras.Variable(np.ones((4, 2)))
    elif use == "layer":
        keras.layers.Dense(2).build((None, 3))
    elif use == "batch":
        distribution_lib.distribute_global_batch(np.ones((8, 3)), distribution)
    elif use == "collective":
        distribution_lib.all_reduce(torch.ones(2), axis_name="model")
    elif use == "layout":
        layout = distribution.get_data_layout((8, 2))
        kd.distribute_tensor(torch.ones(8, 2), layout)
    else:
        raise AssertionError(f"unknown use {use}")


def _mismatched_scope_body(rank, world_size, use):
    import torch.distributed as dist

    from keras import distribution as kd

    # Upstream's `DistributionTest.test_scope` does this in one process.
    devices = [f"cpu:{i}" for i in range(8)]
    distribution = distributions.model_parallel(
        layout_rules={}, mesh_shape=(4, 2), devices=devices
    )
    info = kd.mesh_info(distribution.device_mesh)
    with distribution.scope():
        assert kd.distribution() is distribution
        with kd.DataParallel(devices=devices).scope():
            pass
        assert kd.distribution() is distribution
        try:
            _first_use(use, distribution)
            message = None
        except ValueError as error:
            message = str(error)
    assert kd.distribution() is None
    # Every rank must get here: nobody waits in a collective.
    dist.barrier()
    return message, info


@pytest.mark.parametrize(
    "use", ["variable", "layer", "batch", "collective", "layout"]
)
def test_mismatched_mesh_is_refused_where_first_used_not_when_set(use):
    results = run_on_ranks(
        _mismatched_scope_body,
        world_size=2,
        args=(use,),
        timeout=HANG_TIMEOUT,
    )
    for rank, (message, info) in enumerate(results):
        assert message is not None, f"{use}: no ValueError on rank {rank}"
        for expected in ["8 devices", "cpu:7", "(4, 2)", "2 process"]:
            assert expected in message, (use, expected, message)
        assert message == results[0][0]
        # Describing the mesh needs no torch mesh: it works all the same.
        assert info["coordinate"] == (rank // 2, rank % 2)
        assert info["num_processes"] == 2


# --------------------------------------------------------------------------
# More processes on a node than GPUs is refused before NCCL starts.
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "local_rank, local_world, gpus, expected",
    [
        (0, 1, 1, 0),
        (1, 2, 2, 1),
        (0, 2, 1, "This node runs 2 processes but sees 1 GPU(s)"),
        (2, 2, 2, "This node runs 3 processes but sees 2 GPU(s)"),
    ],
)
def test_each_process_of_a_node_takes_a_gpu_of_its_own(
    monkeypatch, local_rank, local_world, gpus, expected
):
    import torch

    from keras.src.backend.torch.distributed.core import runtime

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    if isinstance(expected, int):
        assert runtime._local_gpu(process_id=5) == expected
        return
    with pytest.raises(ValueError) as error:
        runtime._local_gpu(process_id=5)
    assert expected in str(error.value)
    assert f"--nproc_per_node={gpus}" in str(error.value)
    assert "CUDA_VISIBLE_DEVICES=" in str(error.value)


def test_without_a_launcher_process_i_takes_gpu_i_of_its_node(monkeypatch):
    import torch

    from keras.src.backend.torch.distributed.core import runtime

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert [runtime._local_gpu(i) for i in (0, 3, 4, 9)] == [0, 3, 0, 1]
