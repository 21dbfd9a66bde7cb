"""Steps compiled by `torch.compile` (`jit_compile=True`) on `DTensor`s; a
step torch cannot compile runs eagerly (`run_first`)."""

import contextlib
import functools
import warnings

import torch

from keras.src import tree
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.dtensor_gaps import fallback
from keras.src.backend.torch.distributed.fsdp import fsdp


def compile_step(step_function):
    """`torch.compile` of a step on `DTensor`s, with static shapes: dynamo
    cannot make a constant of a symbolic shape in DTensor's Python code (the
    backward pass rebuilds `DTensor` gradients)."""
    compiled_function = torch.compile(step_function, dynamic=False)

    @functools.wraps(step_function)
    def compiled_step(data):
        with _rank_cache_key():
            return compiled_function(data)

    return compiled_step


def _rank_cache_key():
    """A context keying torch's compile caches by rank: each rank's graph
    slices replicated tensors at its shard's offset, but AOTAutograd keys by
    mesh and placements only, so a rank could run another rank's cached graph
    (pytorch/pytorch#188390). Torch without `cache_key_tag` keys by storage
    address, per process."""
    config = getattr(torch.compiler, "config", None)
    tag = getattr(config, "cache_key_tag", None)
    if tag is None:
        return contextlib.nullcontext()
    return config.patch(cache_key_tag=f"{tag}keras-rank-{runtime.rank()}")


class CompileFailed(Exception):
    """The first compiled call failed; the step runs eagerly instead."""


def run(compiled_step_function, model, data):
    """Runs the compiled step and drops the gradients it leaves, which would
    fail a guard of `zero_grad()` and recompile the step."""
    try:
        return compiled_step_function(data)
    finally:
        model.zero_grad(set_to_none=True)


def run_first(compiled_step_function, model, data):
    """Runs the compiled step; if it fails, restores the variables it may
    have changed (all but the weights), warns and raises `CompileFailed`."""
    state = list(model.non_trainable_variables) + list(model.metrics_variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        state += list(optimizer.variables)
    state = list({id(v): v for v in state}.values())
    saved = [v.value.detach().clone() for v in state]
    try:
        return run(compiled_step_function, model, data)
    except Exception as e:  # torch.compile raises errors of many types.
        if fallback.is_out_of_memory(e):
            raise  # Not a refusal: the eager step needs no less memory.
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
        for size, p in zip(x.device_mesh.shape, x.placements):
            if p.is_shard():
                parts[p.dim] = parts.get(p.dim, 1) * size
        if any(x.shape[dim] % n for dim, n in parts.items()):
            return False
    return True
