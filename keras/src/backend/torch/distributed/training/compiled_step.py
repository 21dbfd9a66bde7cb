"""Steps compiled by `torch.compile` (`jit_compile=True`) on `DTensor`s.

A compiled step is compiled whole, with the graph breaks Keras' step has
anyway (at `loss.backward()`). Two things make that work on DTensors: the
loss and metrics are built before the first compiled call (dynamo cannot
trace their lazy build), and the metrics read predictions detached from
the autograd graph (`step.DistributedStep.metric_predictions`). A step
that torch still cannot compile falls back to the eager one, with a
warning (`run_first`). Compiled steps are cached on disk for each rank
apart (see `compile_step`).
"""

import contextlib
import functools
import warnings

import torch

from keras.src import tree
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.fsdp import fsdp


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


class CompileFailed(Exception):
    """The first compiled call failed; the step runs eagerly instead."""


def run(compiled_step_function, model, data):
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


def run_first(compiled_step_function, model, data):
    """Runs the compiled step; undoes what it changed if it fails.

    Raises:
        CompileFailed: torch could not compile or run it (warned once).
    """
    state = _step_state(model)
    saved = [v.value.detach().clone() for v in state]
    try:
        return run(compiled_step_function, model, data)
    except Exception as e:  # torch.compile raises errors of many types.
        reason = " ".join(str(e).split())[:240]
        warn_eager(f"{type(e).__name__}: {reason}")
        with torch.no_grad():
            for variable, value in zip(state, saved):
                variable.assign(value)
        model.zero_grad()
        raise CompileFailed() from e


def warn_eager(reason):
    warnings.warn(
        "`jit_compile=True`: torch.compile could not compile a step of "
        f"this distributed model ({reason}). Running the step eagerly "
        "instead.",
        stacklevel=4,
    )


def eager_reason(model):
    """Why a compiled step of `model` must run eagerly, or `None`."""
    if not evenly_sharded(model.variables):
        return "some of its variables are sharded unevenly"
    if fsdp.has_gathered_weights(model, runtime.current_distribution()):
        return (
            "weights sharded over the batch axis (or gathered whole for "
            "each call by the distribution's plan) are gathered one layer "
            "at a time and freed after use, which torch.compile cannot trace "
            f"(set {fsdp.GATHER_WEIGHTS_ENV}=off to compile DTensor's own "
            "plan instead)"
        )
    return None


def evenly_sharded(values):
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
