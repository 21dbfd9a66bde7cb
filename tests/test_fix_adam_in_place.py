"""The torch Adam update, computed in place, gives Adam's numbers."""

import numpy as np
import pytest

import keras


def _reference_adam(weights, gradients, learning_rate, amsgrad):
    """Keras' Adam in NumPy (float64): bias-corrected rate, epsilon added
    to the square root of the (maximum) second moment."""
    beta_1, beta_2, epsilon = 0.9, 0.999, 1e-7
    w = weights.astype("float64")
    m, v, v_hat = np.zeros_like(w), np.zeros_like(w), np.zeros_like(w)
    for step, g in enumerate(gradients, 1):
        alpha = learning_rate * np.sqrt(1 - beta_2**step) / (1 - beta_1**step)
        m += (1 - beta_1) * (g - m)
        v = beta_2 * v + (1 - beta_2) * g * g
        if amsgrad:
            v_hat = np.maximum(v_hat, v)
            w -= m * alpha / (np.sqrt(v_hat) + epsilon)
        else:
            w -= m * alpha / (np.sqrt(v) + epsilon)
    return w


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_matches_the_reference(amsgrad):
    rng = np.random.default_rng(0)
    weights = rng.normal(size=(5, 3)).astype("float32")
    gradients = [rng.normal(size=(5, 3)).astype("float32") for _ in range(4)]
    variable = keras.Variable(weights)
    optimizer = keras.optimizers.Adam(learning_rate=0.01, amsgrad=amsgrad)
    for g in gradients:
        optimizer.apply([keras.ops.convert_to_tensor(g)], [variable])
    expected = _reference_adam(weights, gradients, 0.01, amsgrad)
    np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-5, atol=1e-6)
