"""Which compiled losses are computed on each process' rows.

`local_loss` alone, in one process: a built-in loss summed over the batch
and averaged per sample is a share of the global loss each process can
compute on its rows; other reductions, axes and custom losses are not.
The losses computed so on real ranks: `tests/test_local_loss.py`.
"""

import pytest

import keras
from keras.src.backend.torch.distributed.data_parallel import local_loss
from keras.src.losses.losses import LossFunctionWrapper


@pytest.mark.parametrize(
    "loss",
    [
        keras.losses.MeanSquaredError(),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.losses.CategoricalCrossentropy(),
        keras.losses.Huber(),
    ],
    ids=lambda loss: type(loss).__name__,
)
def test_built_in_per_sample_losses(loss):
    assert local_loss._per_sample_loss(loss)


class _Doubled(keras.losses.MeanSquaredError):
    def __call__(self, y_true, y_pred, sample_weight=None):
        return 2 * super().__call__(y_true, y_pred, sample_weight)


@pytest.mark.parametrize(
    "loss",
    [
        keras.losses.MeanSquaredError(reduction="sum"),
        keras.losses.CategoricalCrossentropy(axis=0),
        LossFunctionWrapper(lambda y, p: (y - p) ** 2),
        _Doubled(),
        "mean_squared_error",
    ],
    ids=["sum", "axis_0", "custom_function", "custom_call", "a_name"],
)
def test_other_losses_are_not(loss):
    assert not local_loss._per_sample_loss(loss)
