"""Tiny models, data and layout rules for the training parity tests.

Shared by `tests/test_training_parity.py` (the pytest process computes the
single-process references with these builders) and by its multi-rank bodies
(the harness workers import this module as `tests.parity_models`). Every
builder is deterministic: the same `kind` gives the same data, the same
initial weights (`keras.utils.set_random_seed(SEED)`) and the same training
on one process as on several.

Model kinds (all take a few hundred weights at most):
    "mlp": Dense(31, relu) -> Dense(3); 31 units shard unevenly.
    "cnn": Conv2D sharded on output channels (kernel and bias) ->
        Flatten and GlobalAveragePooling2D -> Dense.
    "attention": Embedding + MultiHeadAttention + LayerNormalization + an
        MLP block; attention kernels sharded on heads, the MLP kernels
        Megatron-style (column then row).
    "lstm": LSTM with `return_state=True`, whose output and states feed the
        head; its `/output` is laid out on the batch axis.
    "batchnorm": Dense -> BatchNormalization (sharded, with its moving
        statistics) -> Dense.
    "dropout": Dense -> Dropout(0.5, seeded) -> Dense.
    "binary": Dense(31, relu) -> Dense(1, sigmoid), a binary classifier
        compiled with count metrics (TruePositives) and accuracy.
    "unseeded_dropout": Dropout(0.5) without a seed on the (replicated)
        inputs -> Dense(31, relu) -> Dense(3); for the RNG tests only.
    "embedding": Embedding (its table sharded on the features) ->
        GlobalAveragePooling1D -> Dense; for the compile cache test only.

Settings are those of `tests.distributions.use_setting`: "single" (no
distribution), "dp" (DataParallel on all ranks), "mp" (ModelParallel on a
(1, N) ("batch", "model") mesh) and "2x2" (ModelParallel on a (2, 2)
("batch", "model") mesh, 4 ranks); `LAYOUT_RULES[kind]` are the layout
rules of model `kind` under the model-parallel ones.
"""

import numpy as np

from tests import distributions

SEED = 1234
# The kinds of the parity zoo (all settings); "binary",
# "unseeded_dropout" and "embedding" serve single tests.
MODEL_KINDS = ("mlp", "cnn", "attention", "lstm", "batchnorm", "dropout")
# The kinds that draw random numbers in training: under a distribution
# drawn by position, their reference is one process under `DataParallel`.
RANDOM_KINDS = ("dropout", "unseeded_dropout")
NUM_CLASSES = 3
RTOL = 1e-4
ATOL = 1e-6

# Input shape (without the batch) and target kind of each model.
_INPUTS = {
    "mlp": ((5,), "regression"),
    "cnn": ((5, 5, 2), "classes"),
    "attention": ((6,), "tokens"),
    "lstm": ((4, 3), "regression"),
    "batchnorm": ((5,), "classes"),
    "dropout": ((5,), "regression"),
    "binary": ((5,), "binary"),
    "unseeded_dropout": ((5,), "regression"),
    "embedding": ((6,), "tokens"),
}
VOCAB_SIZE = 16


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


def make_data(kind, *, num_samples, seed=0):
    """Returns `(x, y)` numpy arrays for the model `kind`.

    Targets depend on the inputs (so training moves the weights in a
    consistent direction), and the same arguments give the same arrays.
    """
    rng = np.random.default_rng(seed)
    shape, target = _INPUTS[kind]
    if target == "tokens":
        x = rng.integers(0, VOCAB_SIZE, size=(num_samples,) + shape)
        y = (x[:, 0] + x[:, -1]) % NUM_CLASSES
        return x.astype("int32"), y.astype("int32")
    x = rng.uniform(-1.0, 1.0, size=(num_samples,) + shape).astype("float32")
    flat = x.reshape(num_samples, -1)
    if target == "classes":
        y = np.argmax(flat[:, :NUM_CLASSES], axis=-1).astype("int32")
        return x, y
    if target == "binary":
        return x, (flat.sum(-1, keepdims=True) > 0).astype("float32")
    y = np.stack(
        [flat.sum(-1), flat[:, 0] * flat[:, -1], np.abs(flat).mean(-1)],
        axis=-1,
    ).astype("float32")
    return x, y


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


def build_model(kind, *, compile_model=True, jit_compile=False, seed=SEED):
    """Builds (and compiles) the model `kind` with seeded initial weights.

    Call it after `set_distribution`, so the variables are laid out.
    `seed=None` leaves the random state alone (no Keras seed is set).
    """
    import keras

    if seed is not None:
        keras.utils.set_random_seed(seed)
    model = _BUILDERS[kind]()
    if compile_model:
        compile_for(model, kind, jit_compile=jit_compile)
    return model


def compile_for(model, kind, *, jit_compile=False):
    """Compiles `model` with the loss and a metric suited to `kind`."""
    import keras

    target = _INPUTS[kind][1]
    if target == "regression":
        loss, metrics = "mse", ["mae"]
    elif target == "binary":
        # A count metric: must not be multiplied by the number of shards.
        loss = "binary_crossentropy"
        metrics = [keras.metrics.TruePositives(name="tp"), "binary_accuracy"]
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        metrics = ["sparse_categorical_accuracy"]
    # Adam keeps sharded optimizer state to compare; its larger epsilon
    # keeps weights whose gradient is ~0 (e.g. the key bias of attention)
    # from turning float noise into full-size, order-dependent updates.
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=0.01, epsilon=1e-3),
        loss=loss,
        metrics=metrics,
        jit_compile=jit_compile,
    )


def _mlp():
    from keras import layers

    inputs = layers.Input(_INPUTS["mlp"][0])
    hidden = layers.Dense(31, activation="relu", name="hidden")(inputs)
    outputs = layers.Dense(3, name="out")(hidden)
    return _functional(inputs, outputs, "mlp")


def _cnn():
    from keras import layers

    inputs = layers.Input(_INPUTS["cnn"][0])
    features = layers.Conv2D(4, 3, activation="relu", name="conv")(inputs)
    pooled = layers.GlobalAveragePooling2D(name="gap")(features)
    flat = layers.Flatten(name="flatten")(features)
    merged = layers.Concatenate(name="concat")([pooled, flat])
    outputs = layers.Dense(NUM_CLASSES, name="out")(merged)
    return _functional(inputs, outputs, "cnn")


def _attention():
    from keras import layers

    inputs = layers.Input(_INPUTS["attention"][0], dtype="int32")
    x = layers.Embedding(VOCAB_SIZE, 8, name="embed")(inputs)
    attended = layers.MultiHeadAttention(num_heads=2, key_dim=4, name="mha")(
        x, x
    )
    x = layers.LayerNormalization(name="norm1")(x + attended)
    hidden = layers.Dense(12, activation="relu", name="ffn_in")(x)
    x = layers.LayerNormalization(name="norm2")(
        x + layers.Dense(8, name="ffn_out")(hidden)
    )
    x = layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = layers.Dense(NUM_CLASSES, name="out")(x)
    return _functional(inputs, outputs, "attention")


def _lstm():
    from keras import layers

    inputs = layers.Input(_INPUTS["lstm"][0])
    output, state_h, state_c = layers.LSTM(6, return_state=True, name="lstm")(
        inputs
    )
    merged = layers.Concatenate(name="concat")([output, state_h, state_c])
    outputs = layers.Dense(3, name="out")(merged)
    return _functional(inputs, outputs, "lstm")


def _batchnorm():
    from keras import layers

    inputs = layers.Input(_INPUTS["batchnorm"][0])
    # No bias: BatchNormalization cancels it, so its gradient is ~0 noise
    # that Adam would blow up into real (and order-dependent) updates.
    x = layers.Dense(8, use_bias=False, name="hidden")(inputs)
    x = layers.BatchNormalization(momentum=0.5, name="bn")(x)
    x = layers.Activation("relu", name="relu")(x)
    outputs = layers.Dense(NUM_CLASSES, name="out")(x)
    return _functional(inputs, outputs, "batchnorm")


def _dropout():
    from keras import layers

    inputs = layers.Input(_INPUTS["dropout"][0])
    x = layers.Dense(16, activation="relu", name="hidden")(inputs)
    # A Keras seed: the mask is drawn from it, identically on every rank.
    x = layers.Dropout(0.5, seed=7, name="drop")(x)
    outputs = layers.Dense(3, name="out")(x)
    return _functional(inputs, outputs, "dropout")


def _binary():
    from keras import layers

    inputs = layers.Input(_INPUTS["binary"][0])
    hidden = layers.Dense(31, activation="relu", name="hidden")(inputs)
    outputs = layers.Dense(1, activation="sigmoid", name="out")(hidden)
    return _functional(inputs, outputs, "binary")


def _unseeded_dropout():
    from keras import layers

    inputs = layers.Input(_INPUTS["unseeded_dropout"][0])
    # No seed: the mask of this replicated activation must still agree on
    # the ranks that hold the same rows.
    x = layers.Dropout(0.5, name="drop")(inputs)
    hidden = layers.Dense(31, activation="relu", name="hidden")(x)
    outputs = layers.Dense(3, name="out")(hidden)
    return _functional(inputs, outputs, "unseeded_dropout")


def _embedding():
    from keras import layers

    inputs = layers.Input(_INPUTS["embedding"][0], dtype="int32")
    x = layers.Embedding(VOCAB_SIZE, 8, name="embed")(inputs)
    x = layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = layers.Dense(NUM_CLASSES, name="out")(x)
    return _functional(inputs, outputs, "embedding")


def _functional(inputs, outputs, name):
    import keras

    return keras.Model(inputs, outputs, name=name)


_BUILDERS = {
    "mlp": _mlp,
    "cnn": _cnn,
    "attention": _attention,
    "lstm": _lstm,
    "batchnorm": _batchnorm,
    "dropout": _dropout,
    "binary": _binary,
    "unseeded_dropout": _unseeded_dropout,
    "embedding": _embedding,
}


# --------------------------------------------------------------------------
# Layout rules and batch parts
# --------------------------------------------------------------------------

# Variable (and output) layouts of the model-parallel settings, as axes.
LAYOUT_RULES = {
    "mlp": {
        "hidden/kernel": (None, "model"),
        "hidden/bias": ("model",),
        "out/kernel": ("model", None),
    },
    "cnn": {
        "conv/kernel": (None, None, None, "model"),
        "conv/bias": ("model",),
    },
    "attention": {
        "embed/embeddings": (None, "model"),
        "mha/(query|key|value)/kernel": (None, "model", None),
        "mha/(query|key|value)/bias": ("model", None),
        "mha/attention_output/kernel": ("model", None, None),
        "ffn_in/kernel": (None, "model"),
        "ffn_in/bias": ("model",),
        "ffn_out/kernel": ("model", None),
    },
    "lstm": {
        "lstm/lstm_cell/kernel": (None, "model"),
        "lstm/lstm_cell/recurrent_kernel": (None, "model"),
        "lstm/output": ("batch", None),
    },
    "batchnorm": {
        "hidden/kernel": (None, "model"),
        "bn/(gamma|beta|moving_mean|moving_variance)": ("model",),
        "out/kernel": ("model", None),
    },
    "dropout": {
        "hidden/kernel": (None, "model"),
        "hidden/bias": ("model",),
        "out/kernel": ("model", None),
    },
}
LAYOUT_RULES["binary"] = LAYOUT_RULES["mlp"]
LAYOUT_RULES["unseeded_dropout"] = LAYOUT_RULES["mlp"]
LAYOUT_RULES["embedding"] = {"embed/embeddings": (None, "model")}


def variable_layout_keys(kind):
    """The LayoutMap keys of model `kind` that are variable paths."""
    return [k for k in LAYOUT_RULES[kind] if not k.endswith("/output")]


def batch_part(setting, *, rank, world_size):
    """`(index, count)` of this rank's part of each global batch.

    Ranks along the "batch" mesh axis hold consecutive parts (as
    `torch.chunk` splits the batch); ranks along "model" the same part.
    """
    if setting == "single":
        return 0, 1
    if setting == "dp":
        return rank, world_size
    shape = distributions.setting_mesh_shape(setting, num_devices=world_size)
    grid = np.arange(world_size).reshape(shape)
    return int(np.argwhere(grid == rank)[0][0]), shape[0]


def local_rows(array, *, batch_size, part, num_parts):
    """This rank's rows of every global batch of `array`, concatenated.

    Each global batch of `batch_size` rows is split like `torch.chunk`
    splits it into `num_parts` parts; part `part` of each is kept.
    """
    pieces = []
    for start in range(0, len(array), batch_size):
        batch = array[start : start + batch_size]
        size = -(-len(batch) // num_parts)
        pieces.append(batch[part * size : (part + 1) * size])
    return np.concatenate(pieces)


# --------------------------------------------------------------------------
# A model with a custom torch `train_step`
# --------------------------------------------------------------------------


def build_custom_step_model(kind):
    """Model `kind` as a `CustomStepModel`, compiled, seeded weights."""
    import keras

    keras.utils.set_random_seed(SEED)
    template = _BUILDERS[kind]()
    model = _custom_step_class()(template.inputs, template.outputs)
    compile_for(model, kind)
    return model


_CUSTOM_STEP_CLASS = []


def _custom_step_class():
    """`keras.Model` subclass whose `train_step` is written in torch."""
    if _CUSTOM_STEP_CLASS:
        return _CUSTOM_STEP_CLASS[0]
    import torch

    import keras

    class CustomStepModel(keras.Model):
        def train_step(self, data):
            x, y = data
            self.zero_grad()
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            loss.backward()
            weights = list(self.trainable_weights)
            gradients = [v.value.grad for v in weights]
            with torch.no_grad():
                self.optimizer.apply(gradients, weights)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return self.get_metrics_result()

    _CUSTOM_STEP_CLASS.append(CustomStepModel)
    return CustomStepModel


# --------------------------------------------------------------------------
# Training runs and their results
# --------------------------------------------------------------------------


def model_state(model):
    """Global values of the model's and optimizer's variables, by path.

    A collective under a distribution: every rank must call it.
    """
    state = {v.path: np.array(v.numpy()) for v in model.weights}
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        for v in optimizer.variables:
            state["optimizer/" + v.path] = np.array(v.numpy())
    return state


def placements(model):
    """`{path: placements as text}` of the model's variables."""
    result = {}
    for v in model.weights:
        value = v.value
        result[v.path] = str(tuple(getattr(value, "placements", ())))
    return result


def fit_result(model, history):
    """What a fit run reports: history, its value types, final state."""
    return {
        "history": history.history,
        "value_types": history_value_types(history.history),
        "state": model_state(model),
    }


def fit_run(
    kind,
    setting,
    *,
    num_samples=24,
    batch_size=8,
    epochs=2,
    validation=True,
    with_placements=False,
    validation_samples=10,
):
    """Builds model `kind` under `setting`, fits it, returns `fit_result`.

    With `validation`, `validation_samples` validation samples are evaluated
    after each epoch (a ragged last validation batch unless `batch_size`
    divides them).
    With `with_placements`, the result also has the variables' placements
    (see `placements`).
    """
    distributions.use_setting(setting, layout_rules=LAYOUT_RULES[kind])
    model = build_model(kind)
    x, y = make_data(kind, num_samples=num_samples)
    validation_data = (
        make_data(kind, num_samples=validation_samples, seed=1)
        if validation
        else None
    )
    history = model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        validation_data=validation_data,
    )
    result = fit_result(model, history)
    if with_placements:
        result["placements"] = placements(model)
    return result


def history_value_types(history):
    """The sorted type names of the values in `history.history`."""
    return sorted(
        {type(v).__name__ for values in history.values() for v in values}
    )


def run_single(function, *args, **kwargs):
    """Runs `function` in this process with no distribution, then cleans up.

    The pytest process computes the single-process references this way.
    """
    import keras

    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    try:
        return function(*args, **kwargs)
    finally:
        keras.backend.clear_session()


# --------------------------------------------------------------------------
# Comparisons
# --------------------------------------------------------------------------


def assert_close(actual, expected, what=""):
    """Recursively compares nested dicts/lists of numbers and arrays."""
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), (
            f"{what}: keys {sorted(actual)} != {sorted(expected)}"
        )
        for key in expected:
            assert_close(actual[key], expected[key], f"{what}/{key}")
        return
    if isinstance(expected, (list, tuple)) and not _is_numeric_list(expected):
        assert len(actual) == len(expected), f"{what}: length differs"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, f"{what}[{i}]")
        return
    if isinstance(expected, (str, bool, type(None))):
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"
        return
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, (
        f"{what}: shape {actual.shape} != {expected.shape}"
    )
    np.testing.assert_allclose(
        actual, expected, rtol=RTOL, atol=ATOL, err_msg=what
    )


def assert_ranks_agree(per_rank, what="result"):
    """Every rank's result equals rank 0's (same tolerance as parity)."""
    for rank, result in enumerate(per_rank[1:], start=1):
        assert_close(result, per_rank[0], f"{what} rank {rank} vs rank 0")


def _is_numeric_list(values):
    return all(isinstance(v, (int, float, np.number)) for v in values)
