"""The models, data and training steps of `bench_weak_scaling.py` (its
docstring describes them): each built from the same seed on every process
and side."""

MODELS = (
    "dense",
    "dense_dropout",
    "lstm_dropout",
    "conv_dropout",
    "own_layer",
    "activity_reg",
    "activity_reg_whole",
    "mlp",
    "mlp_dropout",
    "mlp_own",
    "mlp_reg",
    "attention",
    "llama",
    "llama_dropout",
    "llama_mp",
    "llama_dropout_mp",
)
# The keras-hub causal LMs: tokens per row, vocabulary.
LM_SEQUENCE, LM_VOCAB = 128, 1000
SEQUENCE, FEATURES = 32, 256
MLP_HIDDEN, MLP_CLASSES = 512, 10


def build_model(kind):
    import keras
    from keras import layers
    from keras import ops

    class OwnDense(layers.Layer):
        """A user's per-sample layer: `relu(x @ w + b)`."""

        def __init__(self, units, **kwargs):
            super().__init__(**kwargs)
            self.units = units

        def build(self, shape):
            self.w = self.add_weight((shape[-1], self.units))
            self.b = self.add_weight((self.units,), initializer="zeros")

        def call(self, x):
            return ops.relu(ops.matmul(x, self.w) + self.b)

    keras.utils.set_random_seed(0)
    if kind.startswith("llama"):
        return _llama(dropout=0.1 if "dropout" in kind else 0.0)
    if kind.startswith("mlp"):
        return _mlp(kind, OwnDense)
    if kind == "attention":
        return _attention()
    stack = []
    if kind in ("dense", "dense_dropout"):
        for _ in range(4):
            stack.append(layers.Dense(FEATURES, activation="relu"))
            if kind == "dense_dropout":
                stack.append(layers.Dropout(0.1))
    elif kind == "lstm_dropout":
        stack += [
            layers.LSTM(64, return_sequences=True),
            layers.Dropout(0.1),
            layers.LSTM(64, return_sequences=True),
            layers.Dropout(0.1),
        ]
    elif kind == "conv_dropout":
        for _ in range(4):
            stack.append(layers.Conv1D(128, 3, padding="same"))
            stack.append(layers.SpatialDropout1D(0.1))
    elif kind == "own_layer":
        stack += [OwnDense(FEATURES) for _ in range(3)]
    elif kind.startswith("activity_reg"):
        for i in range(4):
            regularizer = "l2" if i == 1 else None
            stack.append(
                layers.Dense(
                    FEATURES,
                    activation="relu",
                    activity_regularizer=regularizer,
                )
            )
    else:
        raise ValueError(f"Unknown model {kind!r}; choose from {MODELS}.")
    stack.append(layers.Dense(8))
    model = keras.Sequential([keras.Input((SEQUENCE, FEATURES))] + stack)
    model.compile(optimizer="adam", loss="mse")
    return model


def _mlp(kind, own_dense):
    import keras
    from keras import layers

    stack = []
    for _ in range(2):
        if kind == "mlp_own":
            stack.append(own_dense(MLP_HIDDEN))
        else:
            regularizer = "l2" if kind == "mlp_reg" else None
            stack.append(
                layers.Dense(
                    MLP_HIDDEN,
                    activation="relu",
                    kernel_regularizer=regularizer,
                )
            )
        if kind == "mlp_dropout":
            stack.append(layers.Dropout(0.1))
    stack.append(layers.Dense(MLP_CLASSES))
    model = keras.Sequential([keras.Input((FEATURES,))] + stack)
    model.compile(optimizer="adam", loss="mse")
    return model


def _attention():
    import keras
    from keras import layers

    inputs = keras.Input((SEQUENCE, FEATURES))
    attended = layers.MultiHeadAttention(4, FEATURES // 4)(inputs, inputs)
    x = layers.LayerNormalization()(inputs + attended)
    hidden = layers.Dense(2 * FEATURES, activation="relu")(x)
    x = layers.LayerNormalization()(x + layers.Dense(FEATURES)(hidden))
    outputs = layers.Dense(8)(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="mse")
    return model


def _llama(dropout):
    import keras_hub

    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=LM_VOCAB,
        num_layers=2,
        num_query_heads=8,
        num_key_value_heads=4,
        hidden_dim=256,
        intermediate_dim=512,
        dropout=dropout,
    )
    model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer="adam")
    return model


def model_parallel(size):
    """`ModelParallel` on a (size / 2, 2) mesh, the Llama backbone's map."""
    import keras_hub

    from keras import distribution as kd

    if size < 2 or size % 2:
        raise ValueError(
            f"The _mp models need an even number of processes; got {size}."
        )
    mesh = kd.DeviceMesh((size // 2, 2), ["batch", "model"], kd.list_devices())
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    return kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def make_data(kind, rows):
    import numpy as np

    rng = np.random.default_rng(0)
    if kind.startswith("llama"):
        tokens = rng.integers(1, LM_VOCAB, size=(rows, LM_SEQUENCE + 1))
        x = {
            "token_ids": tokens[:, :-1].astype("int32"),
            "padding_mask": np.ones((rows, LM_SEQUENCE), "bool"),
        }
        return x, tokens[:, 1:].astype("int32")
    if kind.startswith("mlp"):
        x = rng.normal(size=(rows, FEATURES)).astype("float32")
        y = rng.normal(size=(rows, MLP_CLASSES)).astype("float32")
        return x, y
    x = rng.normal(size=(rows, SEQUENCE, FEATURES)).astype("float32")
    y = rng.normal(size=(rows, SEQUENCE, 8)).astype("float32")
    return x, y


def whole_model_couples():
    """Makes the probe find every model coupling samples as a whole (the
    path of a model that couples samples outside its layers): for the
    `_whole` models' side by side comparison."""
    from keras.src.backend.torch.distributed.data_parallel import batch_coupling

    batch_coupling.coupling_layers = lambda model, watch: None


def make_step(impl, kind, rows, rank, size):
    """`(model, step)`: `impl`'s model of `kind` and one training step of it
    on the global batch of `rows` per process (`keras_dp`) or this
    process' rows (the others),
    built under the distribution `impl` uses, which is left set."""
    import numpy as np
    import torch

    import keras
    from keras import distribution as kd

    kd.set_distribution(None)
    if impl == "keras_dp" and kind.endswith("_mp"):
        kd.set_distribution(model_parallel(size))
    elif impl == "keras_dp":
        kd.set_distribution(kd.DataParallel())
    if impl == "keras_dp" and kind.endswith("_whole"):
        whole_model_couples()
    model = build_model(kind)
    x, y = make_data(kind, rows * size)
    part = slice(rank * rows, (rank + 1) * rows)
    if impl == "keras_dp":
        return model, lambda: model.train_on_batch(x, y)
    if impl in ("keras_alone", "keras_step_ddp"):
        own_x = keras.tree.map_structure(lambda a: a[part], x)
        own_y = y[part]
        if impl == "keras_step_ddp":
            # Builds the loss and metrics, changing no weight.
            model.test_on_batch(own_x, own_y)
            _calls_through_ddp(model)
        return model, lambda: model.train_on_batch(own_x, own_y)
    # A functional model's variables become torch parameters here.
    model._track_variables()
    ddp = model
    if impl == "keras_ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    local_x = keras.tree.map_structure(
        lambda a: torch.from_numpy(np.asarray(a[part])), x
    )
    local_y = torch.from_numpy(y[part])
    loss_fn = model.loss
    if not isinstance(loss_fn, keras.losses.Loss):
        loss_fn = keras.losses.MeanSquaredError()
    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)

    def step():
        model.zero_grad()
        loss = loss_fn(local_y, ddp(local_x, training=True))
        if model.losses:
            # Regularization and the layers' losses, as Keras adds them.
            loss = loss + sum(model.losses)
        loss.backward()
        variables = model.trainable_variables
        grads = [v.value.grad for v in variables]
        with torch.no_grad():
            optimizer.apply(grads, variables)

    return model, step


def _calls_through_ddp(model):
    """Makes `model`'s outermost calls go through `DistributedDataParallel`,
    which wraps it (its weights synchronized from process 0): Keras' own
    train step then computes, reduces and applies as Keras master's torch
    trainer does with its DDP-wrapped model."""
    import torch

    model._track_variables()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    base, inside = type(model), [False]

    def __call__(self, *args, **kwargs):
        if inside[0]:  # DDP's forward calls the model itself.
            return base.__call__(self, *args, **kwargs)
        inside[0] = True
        try:
            return ddp(*args, **kwargs)
        finally:
            inside[0] = False

    through = type(base.__name__, (base,), {"__call__": __call__})
    object.__setattr__(model, "__class__", through)
