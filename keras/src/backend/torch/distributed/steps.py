"""The torch trainer's step functions, run under the distribution.

Each step receives the global batch, distributes it (see `data_input`) and
runs with plain tensors taken as replicated global values (see
`layer_call`). Keras' own eager train step all-reduces its gradient
buckets while its backward pass runs (see `gradients`). A compiled step
that torch cannot compile falls back to the eager one.
"""

import functools
import warnings

import torch

from keras.src.backend.torch.distributed import data_input
from keras.src.backend.torch.distributed import gradients
from keras.src.backend.torch.distributed import health
from keras.src.backend.torch.distributed import layer_call
from keras.src.backend.torch.distributed import layouts
from keras.src.backend.torch.distributed import runtime


def wrap_step_function(step_function, eager_step_function, model):
    """Runs a train/test/predict step function under the distribution.

    Args:
        step_function: a function of `data`, a list holding one global batch;
            possibly compiled with `torch.compile`.
        eager_step_function: the same function, not compiled.
        model: the model the step belongs to.

    Returns:
        A function of the same signature. Without a distribution it calls
        `step_function` as it is. Under one, it distributes the batch and
        runs the step with plain tensors taken as replicated global values;
        if the compiled step fails on its first call, it warns once,
        restores the state the attempt may have changed, and runs eagerly
        from then on.
    """
    # A compiled step is checked on its first call.
    unchecked = step_function is not eager_step_function
    kind = _step_kind(eager_step_function)

    @functools.wraps(eager_step_function)
    def distributed_step(data):
        distribution = runtime.current_distribution()
        if distribution is None:
            return step_function(data)
        with health.guarded_step(kind, layouts.all_process_groups):
            return run(data, distribution)

    def run(data, distribution):
        nonlocal step_function, unchecked
        data = data_input.distribute_global_batch(data, distribution)
        with layer_call.replicated_plain_tensors():
            if step_function is eager_step_function and kind == "train":
                if _default_train_step(model):
                    with gradients.overlapped_reduction(model):
                        return step_function(data)
            if not unchecked:
                return step_function(data)
            unchecked = False
            try:
                return _first_compiled_step(step_function, model, data)
            except _CompileFailed:
                step_function = eager_step_function
                return eager_step_function(data)

    return distributed_step


def _step_kind(step_function):
    """`"train"` for the step made by `make_train_function`, and so on."""
    for kind in ("train", "test", "predict"):
        if f"make_{kind}_function" in step_function.__qualname__:
            return kind
    return "distributed"


def _default_train_step(model):
    """Whether `model` trains with Keras' own step: one backward pass, then
    `gradients.reduce_with_loss`, which takes the overlapped buckets."""
    from keras.src.backend.torch.trainer import TorchTrainer

    return type(model).train_step is TorchTrainer.train_step


class _CompileFailed(Exception):
    pass


def _first_compiled_step(compiled_step_function, model, data):
    """Runs the compiled step; undoes what it changed if it fails."""
    state = _step_state(model)
    saved = [v.value.detach().clone() for v in state]
    try:
        return compiled_step_function(data)
    except Exception as e:  # torch.compile raises errors of many types.
        reason = " ".join(str(e).split())[:240]
        warnings.warn(
            "`jit_compile=True`: torch.compile could not compile a step of "
            f"this distributed model ({type(e).__name__}: {reason}). "
            "Running the step eagerly instead.",
            stacklevel=3,
        )
        with torch.no_grad():
            for variable, value in zip(state, saved):
                variable.assign(value)
        model.zero_grad()
        raise _CompileFailed() from e


def _step_state(model):
    """Variables a step may change before it fails: all but the weights."""
    state = list(model.non_trainable_variables) + list(model.metrics_variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        state += list(optimizer.variables)
    unique = {id(v): v for v in state}
    return list(unique.values())
