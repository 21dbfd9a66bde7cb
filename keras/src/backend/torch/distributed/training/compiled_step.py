"""Steps compiled by `torch.compile` (`jit_compile=True`) on `DTensor`s; a
step torch cannot compile runs eagerly (`run_first`)."""

import functools
import itertools
import time
import warnings

import torch

from keras.src import tree
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.dtensor_gaps import fallback
from keras.src.backend.torch.distributed.health import health

_first_calls = itertools.count()


def compile_step(step_function):
    """`torch.compile` of a step on `DTensor`s, with static shapes: dynamo
    cannot make a constant of a symbolic shape in DTensor's Python code."""
    compiled_function = torch.compile(step_function, dynamic=False)
    config = getattr(torch.compiler, "config", None)

    @functools.wraps(step_function)
    def compiled_step(data):
        # Caches keyed by rank (torch without `cache_key_tag`: by storage
        # address): AOTAutograd keys by mesh and placements, yet a rank's graph
        # slices replicated tensors at its offset (pytorch/pytorch#188390).
        tag = getattr(config, "cache_key_tag", None)
        if tag is None:
            return compiled_function(data)
        with config.patch(cache_key_tag=f"{tag}keras-rank-{runtime.rank()}"):
            return compiled_function(data)

    return compiled_step


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
    """Runs the compiled step; failing everywhere, restores state it may change
    (not weights), warns, raises `CompileFailed`; on some, raises on all."""
    state = [*model.non_trainable_variables, *model.metrics_variables]
    optimizer = getattr(model, "optimizer", None)
    if getattr(optimizer, "built", False):
        state += optimizer.variables
    saved = {id(v): (v, v.value.detach().clone()) for v in state}
    try:
        outputs = run(compiled_step_function, model, data)
    except Exception as e:  # torch.compile raises errors of many types.
        if fallback.is_out_of_memory(e) or health.is_transport_error(e):
            raise  # Not a refusal: the eager step would fail alike.
        reason = f"{type(e).__name__}: " + " ".join(str(e).split())[:240]
        _agree_on_first_call(reason)
        warn_eager(reason)
        with torch.no_grad():
            for variable, value in saved.values():
                variable.assign(value)
        model.zero_grad()
        raise CompileFailed() from e
    _agree_on_first_call(None)
    return outputs


def _agree_on_first_call(reason):
    """Raises on every process unless all first compiled calls failed or all
    ran (`reason`: why this one's failed, or `None`); agreed in the job's
    store, as another process may still be in a collective."""
    store = health.connect_store(required=True)
    if store is None:
        return
    size, number = runtime.world_size(), next(_first_calls)
    keys = [f"compiled_first/{number}/{rank}" for rank in range(size)]
    store.set(keys[runtime.rank()], reason or "")
    deadline = time.monotonic() + health.current_timeout()
    while not store.check(keys):
        failures = health.peer_failures()
        if failures or time.monotonic() > deadline:
            where = failures[0] if failures else ("?", "no answer")
            raise RuntimeError(
                "`jit_compile=True`: the first compiled step "
                f"{'failed' if reason else 'ran'} on this process, and "
                f"process {where[0]} did not do alike ({where[1]})."
            )
        time.sleep(0.2)
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
        "`jit_compile=True`: torch.compile could not compile a step of this "
        f"distributed model ({reason}). Running the step eagerly instead.",
        stacklevel=4,
    )


def eager_reason(model):
    """Why a compiled step of `model` must run eagerly, or `None`."""
    if not evenly_sharded(model.variables):
        return "some of its variables are sharded unevenly"


def evenly_sharded(values):
    """Whether every `DTensor` in `values` splits into equal shards."""
    for x in tree.flatten(values):
        x = getattr(x, "value", x)
        if isinstance(x, DTensor):
            parts = {}
            for size, p in zip(x.device_mesh.shape, x.placements):
                if p.is_shard():
                    parts[p.dim] = parts.get(p.dim, 1) * size
            if any(x.shape[dim] % n for dim, n in parts.items()):
                return False
    return True
