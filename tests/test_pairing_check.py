"""`AutoModelParallel`'s width pairings, checked at a layer's first call.

Where a feed-forward layer is as wide as its block, widths cannot tell a
kernel reading another kernel's output (row parallel) from one reading the
block's stream (column parallel). `pairing_check` follows the data through
the block's first symbolic call (a meta-device trace), or through a
functional model's graph, and lays such a kernel out again. These tests
run on real processes over gloo and check the layouts, the collectives of
a training step (`CommDebugMode`) and the numbers, against the same model
with the check turned off and against one process with no distribution.
"""

import numpy as np
import pytest

from tests.harness import run_on_ranks

DIM, BATCH = 16, 8
# Placements on the default (1, 2) mesh of `AutoModelParallel`.
COLUMN = "(Replicate(), Shard(dim=1))"
ROW = "(Replicate(), Shard(dim=0))"
REPLICATED = "(Replicate(), Replicate())"


def _gated_block_model(refuses_zeros=False, refuses_trace_on_1=False):
    """A block with a gated feed-forward layer as wide as the block (a
    tiny Gemma's): gate and up read the stream, down reads their
    product. With `refuses_zeros`, its call raises on an input of zeros
    and cannot run on the meta device (it reads a value), so the check
    cannot trace it. With `refuses_trace_on_1`, its call raises in the
    check's trace on process 1 alone (code that depends on the process)."""
    import torch

    import keras
    from keras.src.backend.torch.distributed.tensor_parallel import (
        pairing_check,
    )

    refuses_trace = refuses_trace_on_1 and torch.distributed.get_rank() == 1

    class GatedBlock(keras.layers.Layer):
        def build(self, input_shape):
            self.norm = keras.layers.LayerNormalization(name="norm")
            self.norm.build(input_shape)
            self.gate = keras.layers.Dense(DIM, use_bias=False, name="gate")
            self.up = keras.layers.Dense(DIM, use_bias=False, name="up")
            self.down = keras.layers.Dense(DIM, name="down")
            for layer in (self.gate, self.up, self.down):
                layer.build(input_shape)

        def call(self, x):
            if refuses_zeros and not bool(keras.ops.any(x)):
                raise ValueError("an input of zeros")
            if refuses_trace and pairing_check.active_trace() is not None:
                raise ValueError("traced on process 1")
            h = self.norm(x)
            h = keras.ops.gelu(self.gate(h)) * self.up(h)
            return x + self.down(h)

    inputs = keras.Input((4, DIM))
    outputs = GatedBlock(name="block")(inputs)
    return keras.Model(inputs, outputs)


def _dense_stack_model():
    """Four `Dense` layers as wide as each other, in a functional model:
    column, row, column, row."""
    import keras

    inputs = keras.Input((DIM,))
    h = inputs
    for i in range(4):
        h = keras.layers.Dense(DIM, activation="relu", name=f"d{i}")(h)
    return keras.Model(inputs, h)


def _train(build, shape, distribution):
    import torch
    from torch.distributed.tensor.debug import CommDebugMode

    import keras

    keras.distribution.set_distribution(distribution)
    try:
        keras.utils.set_random_seed(1)
        model = build()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        rng = np.random.default_rng(0)
        x = rng.normal(size=(BATCH,) + shape).astype("float32")
        y = rng.normal(size=(BATCH,) + shape).astype("float32")
        losses = [float(model.train_on_batch(x, y))]
        with CommDebugMode() as comm:
            losses.append(float(model.train_on_batch(x, y)))
        tracked = {id(p) for p in model.parameters()}
        return {
            "losses": losses,
            "comms": comm.get_total_counts(),
            "ops": {str(k): v for k, v in comm.get_comm_counts().items()},
            "weights": {w.path: w.numpy() for w in model.weights},
            "placements": {
                w.path: str(getattr(w.value, "placements", None))
                for w in model.weights
            },
            # The layers hold the variables' own parameter objects.
            "tracked": all(id(w.value) in tracked for w in model.weights),
        }
    finally:
        keras.distribution.set_distribution(None)
        torch.distributed.barrier()


def _checked_and_unchecked_body(rank, world_size, model_name):
    import keras
    from keras.src.backend.torch.distributed.tensor_parallel import (
        pairing_check,
    )
    from keras.src.backend.torch.distributed.training import layer_call

    build, shape = {
        "gated_block": (_gated_block_model, (4, DIM)),
        "dense_stack": (_dense_stack_model, (DIM,)),
        "untraceable_block": (
            lambda: _gated_block_model(refuses_zeros=True),
            (4, DIM),
        ),
        "untraceable_on_one": (
            lambda: _gated_block_model(refuses_trace_on_1=True),
            (4, DIM),
        ),
    }[model_name]
    results = {"single": _train(build, shape, None)}
    results["checked"] = _train(
        build, shape, keras.distribution.AutoModelParallel()
    )
    layer_call.techniques.built = lambda *args: None
    try:
        results["unchecked"] = _train(
            build, shape, keras.distribution.AutoModelParallel()
        )
    finally:
        layer_call.techniques.built = pairing_check.check_layer
    summary = []
    keras.distribution.set_distribution(keras.distribution.AutoModelParallel())
    try:
        model = build()
        keras.distribution.sharding_summary(model, print_fn=summary.append)
    finally:
        keras.distribution.set_distribution(None)
    results["summary"] = "\n".join(summary)
    return results


def _assert_same_numbers(result, single):
    np.testing.assert_allclose(result["losses"], single["losses"], rtol=1e-5)
    for path, value in single["weights"].items():
        np.testing.assert_allclose(
            result["weights"][path], value, rtol=1e-4, atol=1e-6
        )


def _assert_fewer_collectives_same_numbers(result):
    """The checked plan issues fewer collectives than the width pairing,
    both compute one process' numbers, and the layers track the moved
    parameters."""
    checked, unchecked = result["checked"], result["unchecked"]
    assert checked["comms"] < unchecked["comms"], (
        checked["ops"],
        unchecked["ops"],
    )
    assert checked["tracked"] and unchecked["tracked"]
    _assert_same_numbers(checked, result["single"])
    _assert_same_numbers(unchecked, result["single"])


def test_a_gated_block_as_wide_as_its_stream_gets_a_row_parallel_down():
    for result in run_on_ranks(
        _checked_and_unchecked_body, world_size=2, args=("gated_block",)
    ):
        checked, unchecked = result["checked"], result["unchecked"]
        placements = checked["placements"]
        # Widths alone made down column parallel like gate and up.
        assert (
            unchecked["placements"]["block/down/kernel"]
            == (unchecked["placements"]["block/gate/kernel"])
        )
        assert placements["block/gate/kernel"] == COLUMN
        assert placements["block/up/kernel"] == COLUMN
        assert placements["block/down/kernel"] == ROW
        # A row-parallel layer's bias is added once, after its all-reduce.
        assert unchecked["placements"]["block/down/bias"] != REPLICATED
        assert placements["block/down/bias"] == REPLICATED
        assert "its call reads a column-parallel output" in result["summary"]
        # Megatron's pair: one all-reduce forward (down's output), one
        # backward (the norm's output gradient, partial sums from gate and
        # up); no batch axis, so replicated weights' gradients are whole.
        assert checked["comms"] == 2, checked["ops"]
        _assert_fewer_collectives_same_numbers(result)


def test_a_functional_stack_of_equal_widths_alternates_column_and_row():
    for result in run_on_ranks(
        _checked_and_unchecked_body, world_size=2, args=("dense_stack",)
    ):
        checked, unchecked = result["checked"], result["unchecked"]
        for i, placement in enumerate([COLUMN, ROW, COLUMN, ROW]):
            assert checked["placements"][f"d{i}/kernel"] == placement
        assert [unchecked["placements"][f"d{i}/kernel"] for i in range(4)] == [
            COLUMN
        ] * 4
        _assert_fewer_collectives_same_numbers(result)


@pytest.mark.parametrize("where", ["untraceable_block", "untraceable_on_one"])
def test_a_block_the_check_cannot_trace_keeps_its_width_pairing(where):
    """Also where the trace fails on one process alone (its code depends on
    the process): every process keeps the width pairing."""
    for result in run_on_ranks(
        _checked_and_unchecked_body, world_size=2, args=(where,), timeout=120
    ):
        checked, unchecked = result["checked"], result["unchecked"]
        assert checked["placements"] == unchecked["placements"]
        assert checked["placements"]["block/down/kernel"] == COLUMN
        assert checked["comms"] == unchecked["comms"]
        _assert_same_numbers(checked, result["single"])


def test_a_trace_takes_a_failed_call_but_not_an_out_of_memory_error():
    """A block whose call fails on stand-ins keeps its width pairing; an
    out-of-memory error of the trace is raised, as any error of ours."""
    import torch

    import keras
    from keras.src.backend.torch.distributed.tensor_parallel import (
        pairing_check,
    )

    class Failing(keras.layers.Layer):
        def __init__(self, error):
            super().__init__()
            self.error = error

        def call(self, x):
            raise self.error

    inputs = keras.KerasTensor((None, DIM))
    trace = pairing_check._Trace(distribution=None)
    with pytest.raises(pairing_check._CallFailed, match="reads a value"):
        trace.run(Failing(ValueError("reads a value")), (inputs,), {})
    with pytest.raises(torch.cuda.OutOfMemoryError):
        trace.run(Failing(torch.cuda.OutOfMemoryError("oom")), (inputs,), {})
