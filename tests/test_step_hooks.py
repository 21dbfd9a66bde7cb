"""The step object and the train step's hooks with no distribution set: the
step calls Keras' own step function, is found on its model by kind, and
every hook gives upstream's value; the default techniques add nothing.

One process, no `keras.distribution` wiring needed.
"""

import numpy as np
import torch

from keras.src.backend.torch.distributed.training import step


def _model():
    import keras

    keras.distribution.set_distribution(None)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_without_a_distribution_the_step_is_keras_own_function():
    model = _model()
    calls = []

    def function(data):
        calls.append((data, step.running_step(model)))
        return {"loss": 1.5}

    train_step = step.DistributedStep(model, "train", function, function)
    assert step.model_step(model, "train") is train_step
    assert step.model_step(model, "test") is None
    assert train_step(("x", "y")) == {"loss": 1.5}
    assert calls == [(("x", "y"), None)]
    assert step.running_step(model) is None


def test_without_a_running_step_every_hook_gives_upstream_value():
    model = _model()
    y = torch.zeros((4, 2))
    y_pred = torch.ones((4, 2), requires_grad=True)
    gradients = [torch.ones(3)]
    assert step.loss_predictions(model, y, y_pred) is y_pred
    assert step.local_loss(model, y, y_pred, None) is None
    assert step.metric_predictions(model, y_pred) is y_pred
    assert step.reduce_gradients(model, gradients) is gradients
    metric = model.metrics[0]
    with step.local_metric_state(model, metric, 2.5) as value:
        assert value == 2.5
    with step.local_metric_reads(model, metric):
        np.testing.assert_array_equal(
            [np.asarray(v) for v in metric.variables],
            [np.zeros(()), np.zeros(())],
        )


def test_the_default_techniques_add_nothing():
    model = _model()
    techniques = step.Techniques()
    y_pred = torch.ones((4, 2))
    assert techniques.rows(model) is None
    assert techniques.eager_reason(model, None) is None
    assert techniques.predictions(model, None, y_pred) is y_pred
    with techniques.context(None, None) as entered:
        assert entered is None
