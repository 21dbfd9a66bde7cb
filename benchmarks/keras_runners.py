"""Runners of the Keras side: `ModelParallel`, `DataParallel`, or no
distribution (`keras_local_*`), each driving Keras' own training step."""

import torch
import torch.distributed as dist
from bench_counting import count_collectives
from bench_counting import ideal_collectives
from bench_counting import ideal_state_bytes
from bench_counting import local_bytes
from bench_models import keras_model
from bench_models import keras_tp_layouts
from bench_runner import Runner

import keras
from keras.src.backend.torch.distributed.training import gradients
from keras.src.backend.torch.distributed.training.step import DistributedStep


def keras_distribution(impl, kind, relayout_outputs):
    """The Keras distribution of a Keras implementation."""
    devices = keras.distribution.list_devices()
    if impl.startswith("keras_dp"):
        return keras.distribution.DataParallel(devices=devices)
    mesh = keras.distribution.DeviceMesh(
        (1, len(devices)), ("batch", "model"), devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in keras_tp_layouts(kind, relayout_outputs).items():
        layout_map[key] = axes
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def keras_runner(kind, impl, shapes, ref, data, ctx, args):
    """A runner driving Keras' own training step (the one `fit` uses)."""
    distribution = None
    if "_local_" not in impl:
        distribution = keras_distribution(impl, kind, args.relayout_outputs)
    keras.distribution.set_distribution(distribution)
    model = keras_model(kind, shapes)
    model.set_weights([ref[v.path] for v in model.weights])
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=1e-3),
        loss="mse",
        jit_compile=impl.endswith("_jit"),
    )
    model.make_train_function()
    train_function = model.train_function
    x, y = data
    batch = [(x, y, None)]

    def step():
        with ctx():
            return train_function(batch)

    def activate():
        keras.distribution.set_distribution(distribution)

    def count():
        with ctx():
            return keras_collectives(model, train_function, batch)

    def state_bytes():
        variables = list(model.weights) + list(model.optimizer.variables)
        return local_bytes([v.value for v in variables])

    tp = impl.startswith("keras_mp")
    return Runner(
        kind,
        impl,
        step,
        activate,
        count=None if impl.endswith("_jit") else count,
        state_bytes=state_bytes,
        ideal_collectives=ideal_collectives(kind, impl, ref),
        ideal_bytes=ideal_state_bytes(
            ref, keras_tp_layouts(kind), tp, dist.get_world_size()
        ),
        loss_fn=lambda logs: float(keras.ops.convert_to_numpy(logs["loss"])),
    )


def keras_collectives(model, train_function, batch):
    """Collectives of a whole Keras step, its gradient reduction, and of
    the optimizer update alone (after the gradients were reduced)."""
    # Counted with the weights entering the step through DTensor, not as
    # plain leaves (`DistributedStep.local_leaf`): the same buckets and
    # collectives, and the step leaves its raw (possibly `Partial`)
    # gradients in `.grad` for the counts below.
    local_leaf = DistributedStep.local_leaf
    DistributedStep.local_leaf = lambda self, *args: None
    try:
        step = count_collectives(lambda: train_function(batch), [model])
    finally:
        DistributedStep.local_leaf = local_leaf
    weights = model.trainable_weights
    grads = [v.value.grad for v in weights]
    reduced = []
    reduction = count_collectives(
        lambda: reduced.extend(gradients.reduce_gradients(grads))
    )

    def update():
        with torch.no_grad():
            model.optimizer.apply(reduced, weights)

    optimizer = count_collectives(update, [model])
    step["gradient_reduction"] = reduction["total"]
    step["optimizer_alone"] = optimizer["total"]
    # CommDebugMode files what runs after the backward pass (the gradient
    # reduction, the update) under "forward": leave it out there.
    step["forward"] = max(
        0, step["forward"] - reduction["total"] - optimizer["total"]
    )
    return step
