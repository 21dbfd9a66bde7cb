"""The torch trainer's step functions, run under the distribution.

Each step receives the global batch, distributes it (see `data_input`) and
runs with plain tensors taken as replicated global values (see
`layer_call`). Keras' own eager train step all-reduces its gradient
buckets while its backward pass runs (see `step_reduction`).

A compiled step (`jit_compile=True`) is compiled whole by `torch.compile`,
with the graph breaks Keras' step has anyway (at `loss.backward()`). Two
things make that work on DTensors: the loss and metrics are built before
the first compiled call (dynamo cannot trace their lazy build), and the
metrics read predictions detached from the autograd graph (see
`metric_predictions`). A step that torch still cannot compile falls back
to the eager one, with a warning. Compiled steps are cached on disk for
each rank apart (see `compile_step`).
"""

import contextlib
import functools
import warnings

import torch

from keras.src import tree
from keras.src.backend.torch.distributed import data_input
from keras.src.backend.torch.distributed import fallback
from keras.src.backend.torch.distributed import health
from keras.src.backend.torch.distributed import layer_call
from keras.src.backend.torch.distributed import layouts
from keras.src.backend.torch.distributed import local_rows
from keras.src.backend.torch.distributed import runtime
from keras.src.backend.torch.distributed import step_reduction
from keras.src.backend.torch.distributed.runtime import DTensor


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
        a compiled step is compiled anew with static shapes (see
        `compile_step`). Where a variable or a batch is sharded unevenly,
        the step runs eagerly: compiled code assumes equal shards (torch
        2.13). If the compiled step fails on its first call, it warns once,
        restores the state the attempt may have changed, and runs eagerly
        from then on. All processes take the same path, as they decide on
        global shapes.
    """
    # A compiled step is checked on its first call.
    unchecked = step_function is not eager_step_function
    distributed_function = eager_step_function
    if unchecked:
        distributed_function = compile_step(eager_step_function)
    kind = _step_kind(eager_step_function)

    @functools.wraps(eager_step_function)
    def distributed_step(data):
        distribution = runtime.current_distribution()
        if distribution is None:
            return step_function(data)
        with health.guarded_step(kind, layouts.all_process_groups):
            return run(data, distribution)

    def run(data, distribution):
        nonlocal distributed_function, unchecked
        if unchecked:
            # Built eagerly, on the global batch: traced, the lazy build of
            # the loss and metrics breaks dynamo.
            model._symbolic_build(data_batch=data[0])
            reason = _eager_reason(model)
            if reason is not None:
                _warn_eager(reason)
                distributed_function = eager_step_function
                unchecked = False
        data = data_input.distribute_global_batch(data, distribution)
        with layer_call.replicated_plain_tensors():
            if distributed_function is eager_step_function or (
                not _evenly_sharded(data)
            ):
                return _eager_step(eager_step_function, model, kind, data)
            if not unchecked:
                return _compiled_step(distributed_function, model, data)
            unchecked = False
            try:
                return _first_compiled_step(distributed_function, model, data)
            except _CompileFailed:
                distributed_function = eager_step_function
                return _eager_step(eager_step_function, model, kind, data)

    return distributed_step


def compile_step(step_function):
    """`torch.compile` of a step that runs on `DTensor`s.

    Shapes are static: the batches of a step have one shape (the last, if
    ragged, one more), and a dynamic shape reaches DTensor's own Python
    code as a symbol that dynamo cannot make a constant (torch 2.13), as
    the backward pass rebuilds `DTensor` gradients.

    Its compiled code is cached on disk under a key of this rank's own
    (see `_rank_cache_key`).

    Args:
        step_function: the eager step function.

    Returns:
        The compiled function.
    """
    compiled_function = torch.compile(step_function, dynamic=False)

    @functools.wraps(step_function)
    def compiled_step(data):
        with _rank_cache_key():
            return compiled_function(data)

    return compiled_step


def metric_predictions(y_pred):
    """The predictions a train step gives its metrics, after the loss.

    Compiled under a distribution they are detached: the forward part of
    the step would otherwise return them as outputs that require gradients
    but get none from `loss.backward()`, and AOTAutograd fails on the
    missing `DTensor` gradient ("Expected a DTensor tangent but got a
    plain Tensor"). Metrics take no gradients, so the values are the same.

    Args:
        y_pred: the model's outputs (a nested structure of tensors).

    Returns:
        `y_pred` itself unless compiled under a distribution, else its
        detached tensors.
    """
    if (
        runtime.current_distribution() is None
        or not torch.compiler.is_compiling()
    ):
        return y_pred
    return tree.map_structure(
        lambda x: x.detach() if isinstance(x, torch.Tensor) else x, y_pred
    )


def _rank_cache_key():
    """Keys torch's on-disk compile caches by this process' rank.

    Traced through DTensor, a step compiles to a different graph on each
    rank: a replicated tensor that meets a sharded one is cut to this
    rank's shard, a slice whose offset is a constant of the graph. The
    AOTAutograd cache keys a graph by its `DTensor` inputs' mesh and
    placements, the same on every rank (torch 2.13), so a rank that finds
    another rank's entry (written by an earlier run on the same machine, or
    a moment earlier in this one) runs that rank's slices: wrong numbers,
    no error (pytorch/pytorch issue 188390). A rank of its own in
    `cache_key_tag` keeps the entries apart. (A torch without the tag keyed
    a `DTensor` by its storage address, which no other process shares.)

    Returns:
        A context manager.
    """
    config = getattr(torch.compiler, "config", None)
    tag = getattr(config, "cache_key_tag", None)
    if tag is None:
        return contextlib.nullcontext()
    return config.patch(cache_key_tag=f"{tag}keras-rank-{runtime.rank()}")


def _step_kind(step_function):
    """`"train"` for the step made by `make_train_function`, and so on."""
    for kind in ("train", "test", "predict"):
        if f"make_{kind}_function" in step_function.__qualname__:
            return kind
    return "distributed"


def _default_train_step(model):
    """Whether `model` trains with Keras' own step: one backward pass, then
    `step_reduction.reduce_with_loss`, which takes the overlapped buckets."""
    from keras.src.backend.torch.trainer import TorchTrainer

    return type(model).train_step is TorchTrainer.train_step


class _CompileFailed(Exception):
    pass


def _compiled_step(compiled_step_function, model, data):
    """Runs the compiled step and drops the gradients it leaves.

    The step's `zero_grad()` finds no gradients on the first step and the
    last step's on the next ones: a guard that failed on the second step
    and compiled the whole step again. Dropped, every step starts as the
    first did (and the gradients' memory is free between steps).
    """
    try:
        return compiled_step_function(data)
    finally:
        model.zero_grad(set_to_none=True)


def _first_compiled_step(compiled_step_function, model, data):
    """Runs the compiled step; undoes what it changed if it fails."""
    state = _step_state(model)
    saved = [v.value.detach().clone() for v in state]
    try:
        return _compiled_step(compiled_step_function, model, data)
    except Exception as e:  # torch.compile raises errors of many types.
        reason = " ".join(str(e).split())[:240]
        _warn_eager(f"{type(e).__name__}: {reason}")
        with torch.no_grad():
            for variable, value in zip(state, saved):
                variable.assign(value)
        model.zero_grad()
        raise _CompileFailed() from e


def _warn_eager(reason):
    warnings.warn(
        "`jit_compile=True`: torch.compile could not compile a step of "
        f"this distributed model ({reason}). Running the step eagerly "
        "instead.",
        stacklevel=4,
    )


def _eager_reason(model):
    """Why a compiled step of `model` must run eagerly, or `None`."""
    if not _evenly_sharded(model.variables):
        return "some of its variables are sharded unevenly"
    return None


def _evenly_sharded(values):
    """Whether every `DTensor` in `values` splits into equal shards."""
    for x in tree.flatten(values):
        x = getattr(x, "value", x)
        if not isinstance(x, DTensor):
            continue
        parts = {}
        for mesh_dim, placement in enumerate(x.placements):
            if placement.is_shard():
                size = x.device_mesh.size(mesh_dim)
                parts[placement.dim] = parts.get(placement.dim, 1) * size
        if any(x.shape[dim] % n for dim, n in parts.items()):
            return False
    return True


def _step_state(model):
    """Variables a step may change before it fails: all but the weights."""
    state = list(model.non_trainable_variables) + list(model.metrics_variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        state += list(optimizer.variables)
    unique = {id(v): v for v in state}
    return list(unique.values())


def _eager_step(step_function, model, kind, data):
    """Runs an eager step; Keras' own train step reduces during backward.

    Ops that DTensor refuses, forward or backward, are computed on global
    values (see `fallback`); a model that runs on the local rows runs its
    plain tensors without that mode's cost."""
    with fallback.step_fallback(lazy=local_rows.may_run_locally(model)):
        if kind == "train" and _default_train_step(model):
            with step_reduction.overlapped_reduction(model):
                return step_function(data)
        return step_function(data)
