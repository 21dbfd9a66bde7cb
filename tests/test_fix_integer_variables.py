"""Trainable variables of integer or bool dtype on the torch backend.

torch refuses gradients to integer and bool tensors, so such a variable
must not ask for them, whatever its `trainable` flag says.
"""

import numpy as np
import pytest

import keras


@pytest.mark.parametrize(
    "value, dtype",
    [([1, 2, 3], "int32"), ([True, False], "bool"), ([5], "int64")],
)
def test_integer_and_bool_variables_take_no_gradients(value, dtype):
    variable = keras.Variable(value, dtype=dtype)
    assert variable.trainable
    assert not variable.value.requires_grad
    np.testing.assert_array_equal(variable.numpy(), np.array(value, dtype))
    variable.assign(np.array(value, dtype)[::-1].copy())
    np.testing.assert_array_equal(
        variable.numpy(), np.array(value, dtype)[::-1]
    )


def test_float_variables_still_take_gradients():
    variable = keras.Variable([1.0, 2.0])
    assert variable.value.requires_grad
    frozen = keras.Variable([1.0, 2.0], trainable=False)
    assert not frozen.value.requires_grad


def test_a_layer_with_an_integer_weight_trains():
    class Counting(keras.layers.Layer):
        def build(self, input_shape):
            self.kernel = self.add_weight(shape=(input_shape[-1], 2))
            self.calls = self.add_weight(
                shape=(), dtype="int32", initializer="zeros"
            )

        def call(self, x):
            self.calls.assign_add(1)
            return keras.ops.matmul(x, self.kernel)

    model = keras.Sequential([keras.Input((3,)), Counting()])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((4, 3), "float32")
    before = model.layers[0].kernel.numpy().copy()
    model.train_on_batch(x, np.zeros((4, 2), "float32"))
    assert not np.allclose(model.layers[0].kernel.numpy(), before)
    assert int(model.layers[0].calls.numpy()) >= 1
