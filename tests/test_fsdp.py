"""Weights sharded over the batch axis are gathered one layer at a time.

`torch/distributed/fsdp/fsdp.py`: a layer call gathers the layer's own weights
sharded over the batch axis, frees the gathered storage once the call
returns, gathers it again for the backward pass, and reduce-scatters the
gradient to the weight's shards. Each body runs on 2 gloo ranks with
kernels `("batch", None)` on a (2, 1) ("batch", "model") mesh; the
reference is the same code in this process without a distribution (the
path `tests/test_single_process_path.py` shows to be upstream's).
"""

import contextlib

import numpy as np
import pytest

from tests import distributions
from tests.harness import run_on_ranks

_LAYERS = 3
_DIM = 8


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, _DIM)).astype("float32")
    y = rng.standard_normal((6, _DIM)).astype("float32")
    return x, y


def _dense_model():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((_DIM,))]
        + [
            keras.layers.Dense(_DIM, activation="tanh", name=f"dense_{i}")
            for i in range(_LAYERS)
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _train(model, steps=2):
    x, y = _data()
    losses = [float(model.train_on_batch(x, y)) for _ in range(steps)]
    weights = [np.asarray(w) for w in model.get_weights()]
    return losses, weights


def _set_fsdp(gather=None, ahead="1"):
    """Kernels (and tables) `("batch", None)` on a (2, 1) mesh; `gather`
    is `KERAS_DISTRIBUTION_GATHER_WEIGHTS` (unset: the default), `ahead`
    `KERAS_DISTRIBUTION_GATHER_AHEAD` (on by default here, off by default
    on CPUs: the numbers are checked with gathers ahead)."""
    import os

    from keras.src.backend.torch.distributed.fsdp import fsdp
    from keras.src.backend.torch.distributed.fsdp import fsdp_schedule

    if gather is None:
        os.environ.pop(fsdp.GATHER_WEIGHTS_ENV, None)
    else:
        os.environ[fsdp.GATHER_WEIGHTS_ENV] = gather
    os.environ[fsdp_schedule.GATHER_AHEAD_ENV] = ahead
    distributions.use_model_parallel(
        layout_rules={".*(kernel|table)": ("batch", None)}, mesh_shape=(2, 1)
    )


_single_process = distributions.run_without_distribution


def _assert_equal_to_one_process(results, reference):
    ref_losses, ref_weights = reference
    for losses, weights in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, atol=1e-6)
        for w, r in zip(weights, ref_weights):
            np.testing.assert_allclose(w, r, rtol=1e-4, atol=1e-6)


def _step_collectives(model):
    """The loss and collectives of one train step (not of reading the
    weights)."""
    from torch.distributed.tensor.debug import CommDebugMode

    x, y = _data()
    with CommDebugMode() as comm:
        loss = float(model.train_on_batch(x, y))
    counts = {}
    for op, n in comm.get_comm_counts().items():
        name = _COLLECTIVE_NAMES.get(str(op).split(".")[-1], str(op))
        counts[name] = counts.get(name, 0) + n
    return loss, counts


# DTensor's functional collectives and c10d's flat-buffer ones, as
# `CommDebugMode` names them.
_COLLECTIVE_NAMES = {
    "all_gather_into_tensor": "all_gather",
    "_allgather_base_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "all_reduce": "all_reduce",
    "allreduce_": "all_reduce",
}


def _gathered_step_body(rank, world_size):
    from torch.distributed.tensor import DTensor

    _set_fsdp()
    model = _dense_model()
    losses, _ = _train(model, steps=1)
    x, y = _data()
    kernels = {id(layer.kernel.value) for layer in model.layers}
    saved = []

    def pack(t):
        # What autograd keeps of the gathered kernels: whole DTensors.
        if isinstance(t, DTensor) and tuple(t.shape) == (_DIM, _DIM):
            if id(t) not in kernels and t.placements[0].is_replicate():
                saved.append(t)

    # One forward pass with gradients: the gathered storage is freed once
    # each layer returns, though autograd keeps the tensors.
    with _saved_tensors(pack):
        outputs = model(x, training=True)
    after_forward = [t.to_local().untyped_storage().nbytes() for t in saved]
    outputs.sum().backward()
    after_backward = [t.to_local().untyped_storage().nbytes() for t in saved]
    grads = [str(layer.kernel.value.grad.placements) for layer in model.layers]
    model.zero_grad()

    loss, counts = _step_collectives(model)
    losses.append(loss)
    _, weights = _train(model, steps=0)
    return {
        "saved": len(saved),
        "after_forward": after_forward,
        "after_backward": after_backward,
        "grads": grads,
        "counts": counts,
        "run": (losses, weights),
    }


def test_weights_are_gathered_per_layer_and_freed_after_use():
    results = run_on_ranks(_gathered_step_body, world_size=2)
    reference = _single_process(lambda: _train(_dense_model()))
    _assert_equal_to_one_process([r["run"] for r in results], reference)
    for r in results:
        # Autograd kept every gathered kernel but the first layer's (its
        # input needs no gradient), and they held no memory after the
        # forward pass, nor after backward.
        assert r["saved"] == _LAYERS - 1, r
        assert r["after_forward"] == [0] * r["saved"], r
        assert r["after_backward"] == [0] * r["saved"], r
        # Gradients reach the optimizer in the kernels' own shards.
        assert r["grads"] == ["(Shard(dim=0), Replicate())"] * _LAYERS, r
        # Per layer: a gather forward, one backward (not the first layer's:
        # autograd kept nothing of it; nor, in a train step, the last
        # layer's: the step keeps its weights, the backward pass starts
        # with it), a reduce-scatter.
        assert r["counts"].get("all_gather") == 2 * _LAYERS - 2, r
        assert r["counts"].get("reduce_scatter") == _LAYERS, r


def _prefetch_body(rank, world_size, ahead):
    from keras.src.backend.torch.distributed.fsdp import fsdp_call

    _set_fsdp(ahead=ahead)
    model = _dense_model()
    # Whether each gather had been started ahead, forward and backward.
    taken = {"forward": [], "backward": []}
    enter, restore = fsdp_call.CallGather.enter, fsdp_call.CallGather.restore

    def recording_enter(call):
        taken["forward"].append(call.ahead is not None)
        return enter(call)

    def recording_restore(call):
        ahead = call.restoring is not None
        restored = restore(call)
        if restored:
            taken["backward"].append(ahead)
        return restored

    fsdp_call.CallGather.enter = recording_enter
    fsdp_call.CallGather.restore = recording_restore
    steps = []
    try:
        for _ in range(3):
            taken = {"forward": [], "backward": []}
            losses, _ = _train(model, steps=1)
            steps.append(taken)
    finally:
        fsdp_call.CallGather.enter = enter
        fsdp_call.CallGather.restore = restore
    return steps


def test_gathering_ahead_is_off_on_cpus_unless_asked(monkeypatch):
    from keras import distribution as kd
    from keras.src.backend.torch.distributed.fsdp import fsdp_schedule

    mesh = kd.DeviceMesh((1, 1), ["batch", "model"], ["cpu:0"])
    distribution = kd.ModelParallel(
        layout_map=kd.LayoutMap(mesh), batch_dim_name="batch"
    )
    monkeypatch.delenv(fsdp_schedule.GATHER_AHEAD_ENV, raising=False)
    assert not fsdp_schedule.gathers_ahead(distribution)
    monkeypatch.setenv(fsdp_schedule.GATHER_AHEAD_ENV, "1")
    assert fsdp_schedule.gathers_ahead(distribution)
    monkeypatch.setenv(fsdp_schedule.GATHER_AHEAD_ENV, "yes")
    with pytest.raises(ValueError, match="yes"):
        fsdp_schedule.gathers_ahead(distribution)
    off = run_on_ranks(_prefetch_body, world_size=2, kwargs={"ahead": "0"})
    for steps in off:
        assert all(not any(taken["forward"]) for taken in steps), steps
        assert all(not any(taken["backward"]) for taken in steps), steps


def test_the_next_layers_weights_are_gathered_ahead():
    on = run_on_ranks(_prefetch_body, world_size=2, kwargs={"ahead": "1"})
    for steps in on:
        # Backward, from the first step on, the last layer's gradient
        # starts the gather of the layer before it, and so on (the first
        # layer's is not gathered again). Forward, the first step learns the
        # order of the gathers; then every layer's gather but the first is
        # started while the layer before computes, and the last layer keeps
        # its weights for the backward pass (not gathered again).
        assert steps[0] == {
            "forward": [False] * _LAYERS,
            "backward": [False] + [True] * (_LAYERS - 2),
        }, steps
        for taken in steps[1:]:
            assert taken == {
                "forward": [False] + [True] * (_LAYERS - 1),
                "backward": [True] * (_LAYERS - 2),
            }, steps


def _mixed_precision_run():
    """Two steps of the dense model under `mixed_bfloat16`."""
    import keras

    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    try:
        return _train(_dense_model())
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


def _gathered_kernels_saved(model):
    """Runs a forward pass with gradients; returns the gathered (whole,
    replicated) kernels autograd saved for the backward pass."""
    from torch.distributed.tensor import DTensor

    x, _ = _data()
    saved = []

    def pack(t):
        if isinstance(t, DTensor) and tuple(t.shape) == (_DIM, _DIM):
            if t.placements[0].is_replicate():
                saved.append(t)

    with _saved_tensors(pack):
        model(x, training=True)
    return saved


@contextlib.contextmanager
def _saved_tensors(record):
    """Calls `record` with each tensor autograd saves for the backward pass.

    Inside a layer call that gathered and frees its weights, `fsdp`'s own
    pack hook is the innermost, the one autograd calls: it is wrapped.
    """
    import torch

    from keras.src.backend.torch.distributed.fsdp import fsdp

    note_saved = fsdp._note_saved

    def recording(t):
        record(t)
        return note_saved(t)

    def pack(t):
        record(t)
        return t

    fsdp._note_saved = recording
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
    finally:
        fsdp._note_saved = note_saved


def _mixed_precision_body(rank, world_size):
    import keras

    _set_fsdp()
    run = _mixed_precision_run()
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    try:
        saved = _gathered_kernels_saved(_dense_model())
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    return {
        "run": run,
        "saved": [
            (str(t.dtype), t.to_local().untyped_storage().nbytes())
            for t in saved
        ],
    }


def test_mixed_precision_gathers_and_frees_the_compute_copy():
    results = run_on_ranks(_mixed_precision_body, world_size=2)
    reference = _single_process(_mixed_precision_run)
    for r in results:
        # What autograd keeps of the gathered kernels is the bfloat16 copy
        # the layers compute with, and it holds no memory after forward.
        assert r["saved"] == [("torch.bfloat16", 0)] * (_LAYERS - 1), r
        # bfloat16 computations summed in another order: equal to one
        # process within bfloat16's precision.
        losses, weights = r["run"]
        np.testing.assert_allclose(losses, reference[0], rtol=1e-2)
        for w, ref in zip(weights, reference[1]):
            np.testing.assert_allclose(w, ref, rtol=1e-2, atol=1e-3)


def _kept_body(rank, world_size):
    import os

    from keras.src.backend.torch.distributed.fsdp import fsdp

    _set_fsdp()
    os.environ[fsdp.RESHARD_ENV] = "0"
    try:
        model = _dense_model()
        losses, _ = _train(model, steps=1)
        kept = [
            t.to_local().untyped_storage().nbytes()
            for t in _gathered_kernels_saved(model)
        ]
        loss, counts = _step_collectives(model)
        losses.append(loss)
    finally:
        os.environ.pop(fsdp.RESHARD_ENV)
    return {
        "kept": kept,
        "counts": counts,
        "run": (losses, _train(model, 0)[1]),
    }


def test_gathered_weights_can_be_kept_until_backward(monkeypatch):
    from keras.src.backend.torch.distributed.fsdp import fsdp

    monkeypatch.setenv(fsdp.RESHARD_ENV, "sometimes")
    with pytest.raises(ValueError, match="sometimes"):
        fsdp.reshards_after_forward()
    results = run_on_ranks(_kept_body, world_size=2)
    reference = _single_process(lambda: _train(_dense_model()))
    _assert_equal_to_one_process([r["run"] for r in results], reference)
    for r in results:
        # The gathered kernels autograd saved keep their memory, and the
        # backward pass gathers nothing again.
        assert len(r["kept"]) == _LAYERS - 1, r
        assert all(n == _DIM * _DIM * 4 for n in r["kept"]), r
        assert r["counts"].get("all_gather") == _LAYERS, r
        assert r["counts"].get("reduce_scatter") == _LAYERS, r


def _dtensor_plan_body(rank, world_size, gather):
    _set_fsdp(gather)
    model = _dense_model()
    losses, _ = _train(model, steps=1)
    loss, counts = _step_collectives(model)
    losses.append(loss)
    _set_fsdp()
    return {"counts": counts, "run": (losses, _train(model, steps=0)[1])}


def test_gathering_can_be_turned_off_or_extended_to_every_axis():
    reference = _single_process(lambda: _train(_dense_model()))
    off = run_on_ranks(
        _dtensor_plan_body, world_size=2, kwargs={"gather": "off"}
    )
    _assert_equal_to_one_process([r["run"] for r in off], reference)
    # DTensor's own plan: no per-layer reduce-scatter of the gradients.
    assert all("reduce_scatter" not in r["counts"] for r in off), off
    every = run_on_ranks(
        _dtensor_plan_body, world_size=2, kwargs={"gather": "all"}
    )
    _assert_equal_to_one_process([r["run"] for r in every], reference)
    assert all(r["counts"].get("reduce_scatter") == _LAYERS for r in every), (
        every
    )


def test_an_unknown_gather_choice_is_a_value_error(monkeypatch):
    from keras import distribution as kd
    from keras.src.backend.torch.distributed.fsdp import fsdp

    monkeypatch.setenv(fsdp.GATHER_WEIGHTS_ENV, "sometimes")
    mesh = kd.DeviceMesh((1, 1), ["batch", "model"], ["cpu:0"])
    distribution = kd.ModelParallel(
        layout_map=kd.LayoutMap(mesh), batch_dim_name="batch"
    )
    with pytest.raises(ValueError, match="sometimes"):
        fsdp.gathered_mesh_dims(distribution)


def _table_model(jit_compile=False):
    """Layers whose output is a view of their weight (keras-hub's
    `PositionEmbedding` slices its table; the second table's weight is
    gathered ahead, while the first computes), and a SpectralNormalization
    that assigns its kernel in its call."""
    import keras

    class Table(keras.layers.Layer):
        def __init__(self, rows, **kwargs):
            super().__init__(**kwargs)
            self.rows = rows

        def build(self, input_shape):
            self.table = self.add_weight((6, _DIM), name="table")

        def call(self, x):
            return self.table[: self.rows]

    class TableModel(keras.Model):
        def __init__(self):
            super().__init__()
            self.some_rows = Table(4, name="some_rows")
            self.all_rows = Table(6, name="all_rows")
            self.dense = keras.layers.SpectralNormalization(
                keras.layers.Dense(_DIM, name="dense"), name="spectral"
            )

        def call(self, x, training=None):
            rows = keras.ops.mean(self.some_rows(x), axis=0)
            rows = rows + keras.ops.mean(self.all_rows(x), axis=0)
            return self.dense(x + rows, training=training)

    keras.utils.set_random_seed(0)
    model = TableModel()
    model.compile(
        optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile
    )
    return model


def _table_body(rank, world_size, jit_compile):
    import warnings

    _set_fsdp()
    model = _table_model(jit_compile)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = _train(model, steps=3)
    return {"run": run, "warnings": [str(w.message) for w in caught]}


@pytest.mark.parametrize("jit_compile", [False, True])
def test_weight_views_assignments_and_compiled_steps(jit_compile):
    results = run_on_ranks(
        _table_body, world_size=2, kwargs={"jit_compile": jit_compile}
    )
    reference = _single_process(lambda: _train(_table_model(), steps=3))
    _assert_equal_to_one_process([r["run"] for r in results], reference)
    eager = [w for w in results[0]["warnings"] if "gathered one layer" in w]
    # A compiled step says why it runs eagerly.
    assert bool(eager) == jit_compile, results[0]["warnings"]


def _block_model():
    """A block of sublayers, gathered as one: uneven shards (5 or 3 rows
    or entries on 2 processes), biases too, an einsum computed on the
    gathered kernel's local tensor, an activity regularizer and an
    `add_loss` of a branch that does not reach the block's output (the
    gradient reaches the branch's kernel without passing the block's
    outputs), and a sublayer of another dtype policy, which gathers its
    own weights."""
    import keras

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.up = keras.layers.Dense(
                5, activation="tanh", activity_regularizer="l2", name="up"
            )
            # Computed on the local tensors (`local_einsum`): autograd
            # saves views of the gathered kernel, not the kernel.
            self.down = keras.layers.EinsumDense(
                "ab,bc->ac", output_shape=_DIM, bias_axes="c", name="down"
            )
            self.gate = keras.layers.Dense(_DIM, autocast=False, name="gate")
            self.probe = keras.layers.Dense(3, name="probe")

        def call(self, x):
            hidden = self.up(x)
            outputs = self.down(hidden) * keras.ops.sigmoid(self.gate(x))
            # A loss on a branch that does not reach the block's output,
            # computed last: autograd runs its backward first.
            probe = self.probe(hidden)
            self.add_loss(0.01 * keras.ops.sum(keras.ops.square(probe)))
            return outputs

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((_DIM,)), Block(name="block"), keras.layers.Dense(_DIM)]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _block_body(rank, world_size):
    from keras import distribution as kd

    _set_fsdp(ahead="0")
    mesh = kd.DeviceMesh((2, 1), ["batch", "model"])
    layout_map = kd.LayoutMap(mesh)
    layout_map[".*kernel"] = ("batch", None)
    layout_map[".*bias"] = ("batch",)
    kd.set_distribution(kd.ModelParallel(layout_map=layout_map))
    model = _block_model()
    losses, _ = _train(model, steps=1)
    loss, counts = _step_collectives(model)
    losses.append(loss)
    return {"counts": counts, "run": (losses, _train(model, steps=0)[1])}


def test_a_blocks_weights_are_gathered_in_one_collective():
    results = run_on_ranks(_block_body, world_size=2)
    reference = _single_process(lambda: _train(_block_model()))
    _assert_equal_to_one_process([r["run"] for r in results], reference)
    for r in results:
        # Forward: one gather for the block's six weights, one for the
        # gate (another dtype policy), one for the last layer. Backward:
        # the block again (autograd kept nothing of the gate's kernel: its
        # input needs no gradient; the step keeps the last layer's). One
        # reduce-scatter for each of the three gathers.
        assert r["counts"].get("all_gather") == 4, r
        assert r["counts"].get("reduce_scatter") == 3, r


def _cycle_body(rank, world_size):
    import gc

    import keras

    class CycleDense(keras.layers.Dense):
        """Leaves its gathered kernel in a reference cycle on process 0:
        alive there until the garbage collector runs, gone on process 1."""

        def call(self, inputs):
            if rank == 0:
                cycle = [self.kernel.value]
                cycle.append(cycle)
            return super().call(inputs)

    _set_fsdp(ahead="0")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((_DIM,)), CycleDense(_DIM, activation="tanh")]
        + [keras.layers.Dense(_DIM, activation="tanh") for _ in range(2)]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    gc.disable()
    try:
        losses, _ = _train(model, steps=1)
        loss, counts = _step_collectives(model)
    finally:
        gc.enable()
    losses.append(loss)
    return {"counts": counts, "run": (losses, _train(model, steps=0)[1])}


def test_what_is_gathered_again_does_not_depend_on_garbage_collection():
    results = run_on_ranks(_cycle_body, world_size=2, timeout=120)
    reference = _single_process(lambda: _train(_dense_model()))
    _assert_equal_to_one_process([r["run"] for r in results], reference)
    for r in results:
        # The first kernel is not gathered again on either process:
        # autograd saved nothing of it (nor the last: the step keeps it).
        assert r["counts"].get("all_gather") == 2 * _LAYERS - 2, r


def _norm_block_model():
    """A scale and an offset applied to each head of a head-parallel
    activation (as a query's norm is): their gradients, summed over the
    heads, are partial sums over the model axis too."""
    import keras

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.up = keras.layers.Dense(16, activation="tanh", name="up")
            self.down = keras.layers.Dense(_DIM, name="down")

        def build(self, input_shape):
            self.scale = self.add_weight((4,), initializer="ones", name="scale")
            self.offset = self.add_weight(
                (4,), initializer="zeros", name="offset"
            )

        def call(self, x):
            heads = keras.ops.reshape(self.up(x), (-1, 4, 4))
            heads = heads * self.scale + self.offset
            return self.down(keras.ops.reshape(heads, (-1, 16)))

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((_DIM,)), Block(name="block")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _norm_block_body(rank, world_size):
    import os

    from torch.utils._python_dispatch import TorchDispatchMode

    from keras import distribution as kd
    from keras.src.backend.torch.distributed.fsdp import fsdp
    from keras.src.backend.torch.distributed.fsdp import fsdp_gather
    from keras.src.backend.torch.distributed.fsdp import fsdp_schedule

    class Collectives(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional"):
                self.count += "wait" not in func._opname
            return func(*args, **(kwargs or {}))

    os.environ.pop(fsdp.GATHER_WEIGHTS_ENV, None)
    os.environ[fsdp_schedule.GATHER_AHEAD_ENV] = "0"
    mesh = kd.DeviceMesh((2, 2), ["batch", "model"])
    layout_map = kd.LayoutMap(mesh)
    layout_map[".*/up/kernel"] = ("batch", "model")
    layout_map[".*/up/bias"] = ("model",)
    layout_map[".*/down/kernel"] = ("model", "batch")
    layout_map[".*/(scale|offset)|.*/down/bias"] = ("batch",)
    kd.set_distribution(kd.ModelParallel(layout_map=layout_map))
    summed = []
    original = fsdp_gather._FlatGather._summed_over_other_dims

    def recording(self, grads):
        partial = [
            g
            for g in grads
            if g is not None and any(p.is_partial() for p in g.placements[1:])
        ]
        with Collectives() as mode:
            result = original(self, grads)
        summed.append((len(partial), mode.count))
        assert all(
            not any(p.is_partial() for p in g.placements[1:])
            for g in result
            if g is not None
        )
        return result

    fsdp_gather._FlatGather._summed_over_other_dims = recording
    try:
        model = _norm_block_model()
        run = _train(model)
    finally:
        fsdp_gather._FlatGather._summed_over_other_dims = original
    return {"summed": summed, "run": run}


def test_gradients_partial_over_another_axis_are_summed_at_once():
    results = run_on_ranks(_norm_block_body, world_size=4)
    reference = _single_process(lambda: _train(_norm_block_model()))
    _assert_equal_to_one_process([r["run"] for r in results], reference)
    for r in results:
        # Each step's one reduce-scatter of the block: the scale and the
        # offset, partial sums over the model axis, in one all-reduce.
        assert r["summed"] == [(2, 1), (2, 1)], r


def _non_sum_partial_gradient_body(rank, world_size):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    from keras.src.backend.torch.distributed.fsdp import fsdp_gather

    mesh = init_device_mesh("cpu", (world_size,))
    weight = distribute_tensor(
        torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)]
    ).requires_grad_()
    (gathered,) = fsdp_gather.gather([weight], [[Replicate()]]).values()
    # A gradient that is each process' part of a maximum, not of a sum.
    local = torch.full((4, 2), float(rank + 1))
    gathered.backward(
        DTensor.from_local(local, mesh, [Partial("max")], run_check=False)
    )
    return [str(p) for p in weight.grad.placements], weight.grad.to_local()


def test_a_gathered_weights_non_sum_partial_gradient_reduces_to_its_shard():
    per_rank = run_on_ranks(_non_sum_partial_gradient_body, world_size=2)
    for placements, grad in per_rank:
        assert placements == ["S(0)"], placements
        # The maximum over the processes' 1s and 2s, this process' rows.
        assert grad.shape == (2, 2) and bool((grad == 2.0).all()), grad
