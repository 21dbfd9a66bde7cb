"""Compiled metrics updated on each process' rows in Keras' own train and test
steps.

Under `DataParallel`, a compiled metric that is a `Mean` of values (every
built-in accuracy, error and crossentropy metric) only adds sums over the
batch's rows: each process adds its rows' sums, all-reduced at once
(`local_metrics`). The first step checks this against the update through
DTensor; a metric whose values mix the batch's rows stays on DTensor. These
tests check the metrics and weights against one process, and the path.
"""

import pytest

from tests import parity_models as pm
from tests.harness import run_on_ranks

NUM_SAMPLES = 22


def _coupling(y_true, y_pred):
    """Per-row values that depend on the whole batch (its mean)."""
    from keras import ops

    return ops.square(y_pred[:, 0] - ops.mean(y_pred[:, 0]))


def _classifier(coupled):
    """A classifier with compiled and weighted metrics, and its data."""
    import numpy as np

    import keras

    keras.utils.set_random_seed(pm.SEED)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(4),
        ]
    )
    metrics = ["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2)]
    if coupled:
        metrics.append(keras.metrics.MeanMetricWrapper(_coupling, name="mix"))
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=metrics,
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="w")],
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_SAMPLES, 5)).astype("float32")
    y = rng.integers(0, 4, size=(NUM_SAMPLES,))
    weight = rng.uniform(0.5, 2.0, NUM_SAMPLES).astype("float32")
    return model, (x, y, weight)


def _fit(rank=None, world_size=None, *, coupled, batch_size):
    """Two epochs of `_classifier`: the history, the weights, and (on ranks)
    whether metrics took the rows."""
    import numpy as np

    from tests import distributions

    distributions.use_setting("single" if rank is None else "dp")
    model, (x, y, weight) = _classifier(coupled)
    added = []
    if rank is not None:
        from keras.src.backend.torch.distributed.data_parallel import local_rows

        add = local_rows.StepRows.add_metrics

        def counting_add(*args):
            added.append(add(*args))
            return added[-1]

        local_rows.StepRows.add_metrics = counting_add
    history = model.fit(
        x,
        y,
        sample_weight=weight,
        batch_size=batch_size,
        epochs=2,
        shuffle=False,
        verbose=0,
    )
    weights = [np.array(w.numpy()) for w in model.weights]
    result = {"history": history.history, "weights": weights}
    if rank is None:
        return result
    from keras.src.backend.torch.distributed.training.step import model_step

    local_rows.StepRows.add_metrics = add
    return result, (model_step(model, "train").rows.metrics_on_rows, added)


@pytest.mark.parametrize(
    "world_size, batch_size, coupled",
    [(2, 7, False), (4, 8, False), (2, 8, True)],
    ids=["2-uneven", "4", "2-mixing-metric"],
)
def test_compiled_metrics_on_local_rows_like_one_process(
    world_size, batch_size, coupled
):
    # Batches of 7 split 4 + 3 on 2 processes; on 4, batches of 8. After
    # the first step's check, each split step's sums join the gradients'
    # last bucket. A metric whose values mix the rows fails the check:
    # every compiled metric then stays on DTensor.
    kwargs = {"coupled": coupled, "batch_size": batch_size}
    per_rank = run_on_ranks(_fit, world_size=world_size, kwargs=kwargs)
    reference = pm.run_single(_fit, **kwargs)
    for rank, (result, _) in enumerate(per_rank):
        pm.assert_close(result, reference, f"rank {rank}")
    pm.assert_ranks_agree([result for result, _ in per_rank])
    # The last batch, 1 row or 6 on 4 processes (parts of 2, 2, 2, 0), is
    # not split: whole on each process.
    epoch = [True] * (NUM_SAMPLES // batch_size) + [False]
    added = [False] + epoch[1:] + epoch
    expected = (False, [False] * len(added)) if coupled else (True, added)
    assert [path for _, path in per_rank] == [expected] * world_size


def _evaluate(rank=None, world_size=None, *, batch_size):
    """`evaluate` of `_classifier` (with sample weights), twice: the second
    one's results, and (on ranks) its all-reduces."""
    import torch

    from tests import distributions

    distributions.use_setting("single" if rank is None else "dp")
    model, (x, y, weight) = _classifier(coupled=False)
    kwargs = dict(sample_weight=weight, batch_size=batch_size, verbose=0)
    model.evaluate(x, y, **kwargs)  # Probes the call and checks the metrics.
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as profile:
        results = model.evaluate(x, y, return_dict=True, **kwargs)
    if rank is None:
        return results
    events = [e.name for e in profile.events()]
    return results, events.count("gloo:all_reduce")


@pytest.mark.parametrize("world_size, split_steps", [(2, 3), (4, 2)])
def test_evaluate_reduces_each_step_once(world_size, split_steps):
    # Batches of 8, 8 and 6 rows. Each split step's loss and metric sums on
    # the rows are all-reduced together, once; on 4 processes the last
    # batch (parts of 2, 2, 2, 0) is whole on each process: no all-reduce.
    kwargs = {"batch_size": 8}
    per_rank = run_on_ranks(_evaluate, world_size=world_size, kwargs=kwargs)
    reference = pm.run_single(_evaluate, **kwargs)
    for rank, (results, all_reduces) in enumerate(per_rank):
        pm.assert_close(results, reference, f"rank {rank}")
        assert all_reduces == split_steps


def _fit_masked(rank=None, world_size=None):
    """A model whose predictions carry a mask (its first batch masks nothing,
    its second some steps): the history, weights and the metrics' path."""
    import numpy as np

    import keras
    from tests import distributions

    distributions.use_setting("single" if rank is None else "dp")
    keras.utils.set_random_seed(pm.SEED)
    model = keras.Sequential(
        [
            keras.Input((4, 3)),
            keras.layers.Masking(0.0),
            keras.layers.Dense(3),
        ]
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4, 3)).astype("float32")
    x[8:, 2:] = 0.0
    y = rng.integers(0, 3, size=(16, 4))
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    weights = [np.array(w.numpy()) for w in model.weights]
    result = {"history": history.history, "weights": weights}
    if rank is None:
        return result
    from keras.src.backend.torch.distributed.training.step import model_step

    return result, model_step(model, "train").rows.metrics_on_rows


def test_masked_predictions_keep_the_dtensor_path():
    # The mask weighs the metric's values; the rows' predictions do not keep
    # it, so masked predictions never take the rows, even where the first
    # step's mask hides nothing.
    per_rank = run_on_ranks(_fit_masked, world_size=2)
    reference = pm.run_single(_fit_masked)
    for rank, (result, _) in enumerate(per_rank):
        pm.assert_close(result, reference, f"rank {rank}")
    assert [on_rows for _, on_rows in per_rank] == [None, None]
