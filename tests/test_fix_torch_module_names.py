"""Variables of a wrapped torch module keep the module's parameter names.

A `LayoutMap` addresses variables by path, so `TorchModuleWrapper` names
them after `named_parameters()` (`wrapper/0.weight`), not `variable`,
`variable_1`, ...; `TorchLayer` then keys its `ParameterDict`, which refuses
".", with such paths made valid.
"""

import numpy as np

import keras


def _wrapped_model():
    import torch

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
    inputs = keras.Input((3,))
    hidden = keras.layers.TorchModuleWrapper(
        module, name="wrapper", output_shape=(None, 4)
    )(inputs)
    outputs = keras.layers.Dense(2, name="dense")(hidden)
    return keras.Model(inputs, outputs)


def test_wrapped_parameters_keep_their_names():
    model = _wrapped_model()
    paths = sorted(v.path for v in model.variables)
    assert paths == [
        "dense/bias",
        "dense/kernel",
        "wrapper/0.bias",
        "wrapper/0.weight",
    ]
    names = [name for name, _ in model.named_parameters()]
    assert len(names) == 4
    assert all("0_weight" in n or "0_bias" in n or "dense" in n for n in names)


def test_a_model_with_a_wrapped_module_trains_and_reloads(tmp_path):
    model = _wrapped_model()
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    y = np.zeros((8, 2), "float32")
    weight = model.get_layer("wrapper").module[0].weight
    before = weight.detach().clone()
    model.train_on_batch(x, y)
    assert not np.allclose(weight.detach().numpy(), before.numpy())
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    reloaded = _wrapped_model()
    reloaded.load_weights(path)
    np.testing.assert_allclose(
        reloaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6
    )
