"""Steps compiled by `torch.compile` (`jit_compile=True`) on `DTensor`s; a
step torch cannot compile runs eagerly (`run_first`)."""

import contextlib
import datetime
import functools
import itertools
import time
import warnings

import torch
import torch.distributed as dist

from keras.src import tree
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.dtensor_gaps import fallback
from keras.src.backend.torch.distributed.fsdp import fsdp
from keras.src.backend.torch.distributed.health import health

# Numbers the first compiled calls alike on every process (store keys).
_first_calls = itertools.count()


def compile_step(step_function):
    """`torch.compile` of a step on `DTensor`s, with static shapes: dynamo
    cannot make a constant of a symbolic shape in DTensor's Python code."""
    compiled_function = torch.compile(step_function, dynamic=False)

    @functools.wraps(step_function)
    def compiled_step(data):
        with _rank_cache_key():
            return compiled_function(data)

    return compiled_step


def _rank_cache_key():
    """A context keying torch's compile caches by rank: each rank's graph
    slices replicated tensors at its shard's offset, but AOTAutograd keys by
    mesh and placements only (pytorch/pytorch#188390). Torch without
    `cache_key_tag` keys by storage address, per process."""
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
    """Runs the compiled step; if it fails on every process, restores the
    variables it may have changed (all but the weights), warns and raises
    `CompileFailed`. Failed on some processes only, it raises on all."""
    state = list(model.non_trainable_variables) + list(model.metrics_variables)
    optimizer = getattr(model, "optimizer", None)
    if getattr(optimizer, "built", False):
        state += list(optimizer.variables)
    state = list({id(v): v for v in state}.values())
    saved = [v.value.detach().clone() for v in state]
    try:
        outputs = run(compiled_step_function, model, data)
    except Exception as e:  # torch.compile raises errors of many types.
        if fallback.is_out_of_memory(e) or health.is_transport_error(e):
            raise  # Not a refusal: the eager step would fail alike.
        reason = f"{type(e).__name__}: " + " ".join(str(e).split())[:240]
        _agree_on_first_call(reason)
        warn_eager(reason)
        with torch.no_grad():
            for variable, value in zip(state, saved):
                variable.assign(value)
        model.zero_grad()
        raise CompileFailed() from e
    _agree_on_first_call(None)
    return outputs


def _agree_on_first_call(reason):
    """Raises on every process unless all processes' first compiled calls
    failed or all ran (`reason`: why this one's failed, or `None`), lest one
    pair its eager collectives with the others' compiled ones. Agreed in the
    job's store, not by a collective another process may still be in."""
    size = runtime.world_size()
    store = None if size == 1 else health.connect_store(required=True)
    if store is None:
        return
    number = next(_first_calls)
    keys = [f"compiled_first/{number}/{rank}" for rank in range(size)]
    store.set(keys[runtime.rank()], reason or "")
    deadline = time.monotonic() + health.current_timeout()
    while True:
        try:
            store.wait(keys, datetime.timedelta(seconds=0.2))
            break
        except dist.DistStoreError:  # Not all there yet.
            failures = health.peer_failures()
            if failures or time.monotonic() > deadline:
                where = failures[0] if failures else ("?", "no answer")
                raise RuntimeError(
                    "`jit_compile=True`: the first compiled step "
                    f"{'failed' if reason else 'ran'} on this process, and "
                    f"process {where[0]} did not do alike ({where[1]})."
                ) from None
    reasons = [store.get(key).decode() for key in keys]
    failed = [rank for rank, text in enumerate(reasons) if text]
    if failed and len(failed) < size:
        raise RuntimeError(
            "`jit_compile=True`: the first compiled step failed on process "
            f"{failed[0]} ({reasons[failed[0]]}) but ran on process "
            f"{reasons.index('')}: the processes cannot continue alike. "
            "Fix the error, or pass `jit_compile=False` to `compile()`."
        )


def warn_eager(reason):
    """Warns that the step runs eagerly, for `reason`."""
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
