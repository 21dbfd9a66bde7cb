"""Keras' own train and test steps on each process' plain rows
(`row_boundary`).

Once a `DataParallel` train or test step has found that every reader of its
batch takes local rows (the model's call, the compiled loss, the compiled
metrics), the next steps cut the global batch to each process' rows before
the step and keep the model's outputs as they are, without their `DTensor`s.
A reader that cannot take the rows in such a step gets the global batch's
`DTensor`s of them. These tests count the steps taken on plain rows, and
check that every path gives one process' numbers: weights, optimizer state,
history, and the loss tracker's and metrics' state (the tracker counts the
global batch's rows, not this process').
"""

import pytest

from tests import parity_models as pm
from tests.harness import run_on_ranks

# Train steps of a run: 32 rows in batches of 8, 2 epochs.
ROWS, BATCH, EPOCHS = 32, 8, 2
STEPS = ROWS // BATCH * EPOCHS
# The step (1-based) a disturbance starts at: the sixth, on plain rows.
DISTURBED_STEP = 6


def _build(keras, variant):
    """A functional MLP through a user's layer that draws from Python's
    generator once `draws` is set (the draw changes no number); with
    `"fixed_batch"`, an input spec that checks the global batch's size; with
    `"attention"`, self-attention over two halves of the hidden features."""
    import random

    class MaybeDraws(keras.layers.Layer):
        draws = False

        def call(self, x):
            if MaybeDraws.draws:
                random.random()
            return x * 2.0

    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    if variant == "attention":
        halves = keras.layers.Reshape((2, 4))(hidden)
        # No biases: the key's gets no gradient, only Adam's view of noise.
        attention = keras.layers.MultiHeadAttention(2, 2, use_bias=False)(
            halves, halves
        )
        hidden = keras.layers.Flatten()(attention)
    hidden = MaybeDraws()(hidden)
    outputs = keras.layers.Dense(3)(hidden)
    model = keras.Model(inputs, outputs)
    if variant == "fixed_batch":
        model.input_spec = keras.InputSpec(shape=(BATCH, 6))
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model, MaybeDraws


class _Disturbance:
    """Counts the steps taken on plain rows and, from `DISTURBED_STEP` on,
    makes one reader unable to take them: `"draw"` (the model's call draws
    from a global generator), `"loss"` or `"metrics"` (stand-ins that
    decline the rows, once)."""

    def __init__(self, kind, drawing_layer):
        self.kind, self.layer, self.step = kind, drawing_layer, 0
        self.plain = {"train": 0, "test": 0}

    def __enter__(self):
        from keras.src.backend.torch.distributed.data_parallel import local_loss
        from keras.src.backend.torch.distributed.data_parallel import local_rows

        take = local_rows.StepRows.take_plain_rows
        rows_loss = local_loss.rows_compiled_loss
        add_metrics = local_rows.StepRows.add_metrics
        self.swaps = [
            (local_rows.StepRows, "take_plain_rows", take),
            (local_loss, "rows_compiled_loss", rows_loss),
            (local_rows.StepRows, "add_metrics", add_metrics),
        ]

        def counted(rows, data, distribution, kind):
            if kind == "train":
                self.step += 1
            if self.kind == "draw" and self.step == DISTURBED_STEP:
                self.layer.draws = True
            taken = take(rows, data, distribution, kind)
            self.plain[kind] += taken is not None
            return taken

        def declined(name, original):
            def function(*args, **kwargs):
                if self.kind == name and self.step == DISTURBED_STEP:
                    return None if name == "loss" else False
                return original(*args, **kwargs)

            return function

        local_rows.StepRows.take_plain_rows = counted
        local_loss.rows_compiled_loss = declined("loss", rows_loss)
        local_rows.StepRows.add_metrics = declined("metrics", add_metrics)
        return self

    def __exit__(self, *exc_info):
        for owner, name, original in self.swaps:
            setattr(owner, name, original)
        self.layer.draws = False


def _run(setting, kind="none", variant="arrays"):
    """Fits `variant`'s model under `setting` on arrays (`"loader"`: a torch
    `DataLoader`), then evaluates it: its numbers, and the train and test
    steps taken on plain rows (with `kind`'s disturbance)."""
    import contextlib

    import numpy as np

    import keras
    from tests import distributions

    distributions.use_setting(setting)
    keras.utils.set_random_seed(pm.SEED)
    model, drawing_layer = _build(keras, variant)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = rng.integers(0, 3, size=(ROWS,))
    weights = rng.uniform(0.5, 1.5, size=(ROWS,)).astype("float32")
    disturbance = contextlib.nullcontext()
    if setting != "single":
        disturbance = _Disturbance(kind, drawing_layer)
    data = dict(x=x, y=y, sample_weight=weights, batch_size=BATCH)
    if variant == "loader":
        import torch

        tensors = [torch.from_numpy(a) for a in (x, y, weights)]
        dataset = torch.utils.data.TensorDataset(*tensors)
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH)
        data = dict(x=loader)
    with disturbance:
        history = model.fit(**data, epochs=EPOCHS, shuffle=False, verbose=0)
        result = pm.fit_result(model, history)
        result["metric_state"] = {
            v.path: np.array(v.numpy()) for v in model.metrics_variables
        }
        result["evaluate"] = model.evaluate(
            x, y, sample_weight=weights, batch_size=BATCH, verbose=0
        )
    plain = getattr(disturbance, "plain", None)
    return result, plain


def _body(rank, world_size, kinds):
    import keras

    results = []
    for kind, variant in kinds:
        keras.backend.clear_session()
        results.append(_run("dp", kind, variant))
    return results


def _check(per_rank, kinds, expected_plain):
    references = {}
    for rank, results in enumerate(per_rank):
        for (kind, variant), (result, plain) in zip(kinds, results):
            what = f"rank {rank}, {kind}, {variant}"
            model = "attention" if variant == "attention" else "mlp"
            if model not in references:
                references[model] = pm.run_single(
                    _run, "single", "none", variant
                )[0]
            pm.assert_close(result, references[model], what)
            # The train steps as expected; evaluate's 4 test steps on plain
            # rows from the third, but with the batch size fixed.
            test_steps = 0 if variant == "fixed_batch" else 2
            expected = {"train": expected_plain[(kind, variant)]}
            assert plain == dict(expected, test=test_steps), (what, plain)
    pm.assert_ranks_agree([[r for r, _ in results] for results in per_rank])


# Steps on plain rows: from the third (the first probes the model, the
# second finds every reader takes rows); a model's call that draws from a
# global generator goes through DTensor from then on; a loss or metrics that
# decline the rows once make the next step go through DTensors, and the
# steps after take plain rows again; an input spec fixing the batch size
# (which this process' rows would fail), none. A `DataLoader`'s batches,
# assembled as `DTensor`s before the step, alike; and an attention model.
_EXPECTED = {
    ("none", "arrays"): STEPS - 2,
    ("draw", "arrays"): DISTURBED_STEP - 2,
    ("loss", "arrays"): STEPS - 3,
    ("metrics", "arrays"): STEPS - 3,
    ("none", "fixed_batch"): 0,
    ("none", "loader"): STEPS - 2,
    ("draw", "loader"): DISTURBED_STEP - 2,
    ("draw", "attention"): DISTURBED_STEP - 2,
}


def test_steps_on_plain_rows_and_their_fallbacks_give_one_process_numbers():
    kinds = list(_EXPECTED)
    per_rank = run_on_ranks(_body, world_size=2, args=(kinds,))
    _check(per_rank, kinds, _EXPECTED)


@pytest.mark.parametrize("world_size", [1, 4])
def test_steps_on_plain_rows_on_one_and_four_processes(world_size):
    kinds = [("none", "arrays"), ("draw", "loader")]
    per_rank = run_on_ranks(_body, world_size=world_size, args=(kinds,))
    _check(per_rank, kinds, _EXPECTED)


def _sdpa_body(rank, world_size):
    from keras.src.backend.torch.distributed.training import layer_call
    from tests import distributions

    distributions.use_setting("dp")
    enabled = layer_call._enabled_sdpa_backends
    seen = {"outside": enabled()}
    with layer_call.replicated_plain_tensors(math_sdpa=False):
        seen["plain rows step"] = enabled()
        with layer_call.replicated_plain_tensors():
            seen["DTensor call within"] = enabled()
    with layer_call.replicated_plain_tensors():
        seen["step"] = enabled()
    seen["after"] = enabled()
    return {where: [b.name for b in kinds] for where, kinds in seen.items()}


def test_a_step_on_plain_rows_leaves_math_sdpa_to_dtensor_calls_within():
    # A CPU mesh's step runs math SDPA (DTensor has no rule for the CPU
    # flash kernel); a step on plain rows keeps the kernels one process
    # runs, and a call on DTensors within it (a fallback) takes math.
    (seen,) = run_on_ranks(_sdpa_body, world_size=1)
    assert "FLASH_ATTENTION" in seen["outside"], seen
    assert seen["plain rows step"] == seen["outside"], seen
    assert seen["DTensor call within"] == ["MATH"], seen
    assert seen["step"] == ["MATH"], seen
    assert seen["after"] == seen["outside"], seen
