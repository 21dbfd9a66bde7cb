"""A per-sample compiled loss computed on each process' rows.

Under `DataParallel`, when the model ran on the local rows (`local_rows`)
and its compiled loss is a built-in per-sample loss summed over the batch,
each process computes its share of the global loss on its own rows
(`local_loss`): its weighted sum over the global count of values. These
tests check the numbers against one process (uneven batch parts, sample
weights, loss weights, a ragged last batch) and which losses take the path.
"""

import pytest

from tests import parity_models as pm
from tests.harness import run_on_ranks

NUM_SAMPLES = 22


def _counting_local_losses(function, *args, **kwargs):
    """`(function(...), number of losses computed on the local rows)`."""
    from keras.src.backend.torch.distributed.data_parallel import local_loss

    shares = []
    loss_share = local_loss._loss_share

    def counting_loss_share(*share_args, **share_kwargs):
        share = loss_share(*share_args, **share_kwargs)
        shares.append(share is not None)
        return share

    local_loss._loss_share = counting_loss_share
    try:
        result = function(*args, **kwargs)
    finally:
        local_loss._loss_share = loss_share
    return result, sum(shares)


def _loss(name):
    import keras
    from keras import ops

    if name == "sparse_logits":
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name == "batch_mean":
        # Not a built-in loss: computed through DTensor on the global batch.
        return lambda y, p: ops.mean(ops.square(y - p)) * ops.ones_like(y)
    return name


# Megatron's MLP: the output is replicated after the row-parallel layer.
MODEL_PARALLEL_RULES = {
    "hidden/kernel": (None, "model"),
    "hidden/bias": ("model",),
    "out/kernel": ("model", None),
}


def _fit(
    rank=None, world_size=None, *, loss, batch_size, options=(), setting="dp"
):
    import numpy as np

    import keras
    from tests import distributions

    if rank is None:
        distributions.use_setting("single")
    else:
        distributions.use_setting(setting, layout_rules=MODEL_PARALLEL_RULES)
    keras.utils.set_random_seed(pm.SEED)
    regularizer = activity = None
    if "regularizer" in options:
        regularizer = keras.regularizers.L2(0.5)
    if "activity" in options:
        activity = keras.regularizers.L2(0.1)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(
                8,
                activation="relu",
                name="hidden",
                kernel_regularizer=regularizer,
                activity_regularizer=activity,
            ),
            keras.layers.Dense(3, name="out", kernel_regularizer=regularizer),
        ]
    )
    loss_weights = 0.5 if "loss_weight" in options else None
    model.compile(optimizer="adam", loss=_loss(loss), loss_weights=loss_weights)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_SAMPLES, 5)).astype("float32")
    if loss == "sparse_logits":
        y = rng.integers(0, 3, size=(NUM_SAMPLES,))
    else:
        y = rng.normal(size=(NUM_SAMPLES, 3)).astype("float32")
    sample_weight = None
    if "sample_weight" in options:
        sample_weight = rng.uniform(0.5, 2.0, NUM_SAMPLES).astype("float32")
    history = model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=batch_size,
        epochs=2,
        shuffle=False,
        verbose=0,
    )
    weights = [np.array(w.numpy()) for w in model.weights]
    return {"loss": history.history["loss"], "weights": weights}


def _fit_body(rank, world_size, kwargs):
    return _counting_local_losses(_fit, rank, world_size, **kwargs)


def _check(kwargs):
    """Fits on 2 processes and alone; returns the local losses per rank."""
    per_rank = run_on_ranks(_fit_body, world_size=2, args=(kwargs,))
    reference = pm.run_single(_fit, **kwargs)
    for rank, (result, _) in enumerate(per_rank):
        pm.assert_close(result, reference, f"rank {rank}")
    pm.assert_ranks_agree([result for result, _ in per_rank])
    return [local_losses for _, local_losses in per_rank]


@pytest.mark.parametrize(
    "kwargs",
    [
        # Batches of 7 split 4 + 3; the last batch of 1 row would leave a
        # process without rows: it is gathered whole on each, its outputs
        # replicated.
        dict(loss="mse", batch_size=7, options=("sample_weight",)),
        dict(loss="sparse_logits", batch_size=8, options=("loss_weight",)),
        # Outputs replicated under ModelParallel: the whole loss on every
        # process.
        dict(
            loss="mse", batch_size=8, options=("sample_weight",), setting="mp"
        ),
        # The weights' regularization, computed on their local values, and
        # an activity regularizer's loss (its layer alone through DTensor),
        # added by the mesh's first process.
        dict(
            loss="mse",
            batch_size=7,
            options=("regularizer", "sample_weight", "loss_weight"),
        ),
        dict(loss="mse", batch_size=8, options=("regularizer", "activity")),
    ],
    ids=[
        "mse-uneven-weighted",
        "sparse-logits-loss-weight",
        "mp-replicated",
        "regularization-loss",
        "regularization-and-activity-losses",
    ],
)
def test_per_sample_loss_on_local_rows_like_one_process(kwargs):
    local_losses = _check(kwargs)
    # 2 epochs of 3 batches each split over both processes, or replicated.
    # Split, the first step's call is the probe's, through DTensor (see
    # `local_rows.call`). A ragged last batch of 1 row, gathered whole, has
    # its loss computed whole too, unless losses of the weights join it
    # (computed on the local rows' weights, which that call did not use).
    expected = 6 if kwargs.get("setting") == "mp" else 5
    if kwargs["batch_size"] == 7 and "regularizer" not in kwargs["options"]:
        expected += 2
    assert local_losses == [expected, expected]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(loss="batch_mean", batch_size=8),
        # Model-parallel outputs are replicated: the whole loss on every
        # process, to which the other losses are not added.
        dict(loss="mse", batch_size=8, options=("regularizer",), setting="mp"),
    ],
    ids=["custom-loss", "mp-regularization-loss"],
)
def test_other_losses_run_on_dtensor(kwargs):
    assert _check(kwargs) == [0, 0]


def _backpropagated_losses(rank=None, world_size=None, *, scaled):
    """Three steps of a small model: their losses, the final weights, and the
    type of each loss the train step hands the optimizer to scale."""
    import numpy as np

    import keras
    from tests import distributions

    distributions.use_setting("single" if rank is None else "dp")
    keras.utils.set_random_seed(pm.SEED)
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(8), keras.layers.Dense(3)]
    )
    optimizer = keras.optimizers.Adam(0.01)
    if scaled:
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    model.compile(optimizer=optimizer, loss="mse")
    types, scale_loss = [], optimizer.scale_loss

    def recording_scale_loss(loss):
        types.append(type(loss).__name__)
        return scale_loss(loss)

    optimizer.scale_loss = recording_scale_loss
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5)).astype("float32")
    y = rng.normal(size=(8, 3)).astype("float32")
    losses = [float(model.train_on_batch(x, y)) for _ in range(3)]
    weights = [np.array(w.numpy()) for w in model.weights]
    return {"losses": losses, "weights": weights}, types


@pytest.mark.parametrize("scaled", [False, True], ids=["adam", "loss-scale"])
def test_the_backward_pass_starts_from_this_process_plain_term(scaled):
    # On the local rows the loss is this process' term of a sum over the
    # processes: backpropagated as a plain tensor, the gradients are the
    # terms the step sums (no DTensor in the backward pass). An optimizer
    # that scales the loss by a variable (a replicated DTensor) gets the
    # loss as a DTensor, partial over the processes.
    per_rank = run_on_ranks(
        _backpropagated_losses, world_size=2, kwargs={"scaled": scaled}
    )
    reference, _ = pm.run_single(_backpropagated_losses, scaled=scaled)
    for rank, (result, _) in enumerate(per_rank):
        pm.assert_close(result, reference, f"rank {rank}")
    # The first step is the probe's, through DTensor.
    expected = ["DTensor"] * 3 if scaled else ["DTensor"] + ["Tensor"] * 2
    assert [types for _, types in per_rank] == [expected, expected]
