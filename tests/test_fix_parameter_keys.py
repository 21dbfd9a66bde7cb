"""A weight whose name holds "." on the torch backend.

`TorchLayer` tracks weights in a `ParameterDict` keyed by path, and
`ParameterDict` refuses keys with "."; such a weight (`name="scale.v1"`, or
a wrapped torch module's `0.weight`) raised `KeyError` when the layer was
built. The keys are made valid; the variables keep their paths.
"""

import numpy as np

import keras


class _Scale(keras.layers.Layer):
    def build(self, input_shape):
        self.scale = self.add_weight(
            shape=(input_shape[-1],), initializer="ones", name="scale.v1"
        )

    def call(self, x):
        return x * self.scale


def test_a_weight_named_with_a_dot_is_tracked_and_trained():
    model = keras.Sequential([keras.Input((3,)), _Scale(name="s")])
    (variable,) = model.variables
    assert variable.path.endswith("s/scale.v1")
    assert len(list(model.parameters())) == 1
    model.compile(optimizer="sgd", loss="mse")
    model.train_on_batch(np.ones((4, 3), "float32"), np.zeros((4, 3)))
    assert np.all(model.layers[0].scale.numpy() < 1.0)


def test_untracking_a_weight_named_with_a_dot():
    layer = _Scale()
    layer.build((None, 2))
    layer._track_variables()
    assert len(list(layer.parameters())) == 1
    layer._untrack_variable(layer.scale)
    assert list(layer.parameters()) == []
