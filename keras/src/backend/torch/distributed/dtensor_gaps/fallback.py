"""Ops DTensor refuses, computed on global values by dispatch modes around
layer calls and steps (unlike `register_sharding`, they see every op, backward
included). DTensor refuses alike on every process, so the gathers pair up."""

import contextlib
import functools
import os
import threading
import traceback

import torch
from torch.overrides import TorchFunctionMode

# A private module, but the documented base class of torch dispatch modes.
from torch.utils._python_dispatch import TorchDispatchMode

from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.dtensor_gaps import global_values
from keras.src.backend.torch.distributed.dtensor_gaps import linear_partials
from keras.src.backend.torch.distributed.dtensor_gaps import refused_on_rows
from keras.src.backend.torch.distributed.dtensor_gaps import sharded_positions

_LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default
_ARGMAX, _ARGMIN = torch.ops.aten.argmax.default, torch.ops.aten.argmin.default
# What DTensor raises when it cannot compute an op on these placements
# (`IndexError`: its planner padding a sharded dim, in some releases).
_REFUSALS = (RuntimeError, ValueError, AssertionError, IndexError)
_DTENSOR_PACKAGE = os.path.join("torch", "distributed", "tensor", "")

_state = threading.local()

fallback_counts = global_values.fallback_counts
reset_fallback_counts = global_values.reset_fallback_counts

_STRIDED_SHARD = (
    "a strided shard (a view merging a sharded dimension into an outer one), "
    "gathered along its mesh axes"
)
_LOCAL_SCALAR = (
    "a number read from a partial sum or a shard, where DTensor reads this "
    "process' part (pytorch/pytorch#166638)"
)


@contextlib.contextmanager
def dtensor_fallback(lazy=False):
    """Computes ops DTensor refuses on global values, in this thread (nothing
    more nested or compiled); with `lazy`, the modes (a cost on every op) go on
    at a nested entry or a call of the yielded function, until the exit."""
    entered = getattr(_state, "step_modes", None)
    if entered is not None or torch.compiler.is_compiling():
        _enter_modes(entered)  # Nothing while compiling or once on.
        yield lambda: None
        return
    _state.step_modes = entered = []
    try:
        if not lazy:
            _enter_modes(entered)
        yield functools.partial(_enter_modes, entered)
    finally:
        _state.step_modes = None
        for mode in reversed(entered):
            mode.__exit__(None, None, None)


def _enter_modes(entered):
    """Enters the modes for the rest of the outermost `dtensor_fallback`."""
    if entered or torch.compiler.is_compiling():
        return
    for mode in (_FunctionFallbackMode(), _FallbackMode()):
        mode.__enter__()
        entered.append(mode)


class _FallbackMode(TorchDispatchMode):
    """Runs each op as DTensor does, on global values where it refuses."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not any(issubclass(t, DTensor) for t in types):
            return func(*args, **kwargs)
        fall_back = functools.partial(
            global_values.on_global_values, func, args, kwargs
        )
        if func is _LOCAL_SCALAR_DENSE and not all(
            p.is_replicate() for p in args[0].placements
        ):
            return fall_back(_LOCAL_SCALAR, str(func))
        result = linear_partials.on_partial_sums(func, args, kwargs)
        if func in (_ARGMAX, _ARGMIN):
            result = sharded_positions.positions(func, args, kwargs)
        if result is not None:
            return result
        mutated = global_values.mutated_operands(func, args, kwargs)
        if any(not isinstance(x, DTensor) for x in mutated):
            # `plain += dtensor`: DTensor writes, then refuses to return it.
            return fall_back(None, str(func), mutated)
        try:
            outputs = func(*args, **kwargs)
        except _REFUSALS as e:
            if isinstance(e, torch.distributed.DistError) or not is_refusal(e):
                raise
            refusal = e
        else:
            if mutated:
                return outputs
            return global_values.map_leaves(
                lambda x: _without_strided_shards(x, func), outputs
            )
        if torch.Tag.inplace_view in func.tags:
            raise _InPlaceViewRefused(
                f"{func} changes the shape of a DTensor in place, which "
                "DTensor cannot do on these placements."
            ) from refusal
        if not mutated:
            outputs = refused_on_rows.on_local_rows(func, args, kwargs, refusal)
            if outputs is not None:
                return outputs
        return fall_back(refusal, str(func), mutated)


def is_refusal(error):
    """Whether `error` is DTensor refusing an op: neither out of memory (global
    values need more) nor an assertion outside DTensor (a bug to surface)."""
    if is_out_of_memory(error):
        return False
    if isinstance(error, AssertionError):
        frames = traceback.extract_tb(error.__traceback__)
        return bool(frames) and _DTENSOR_PACKAGE in frames[-1].filename
    return True


def is_out_of_memory(error):
    """Whether `error` or an error it was raised from is out of memory."""
    cause, seen = error, set()
    # An error raised twice makes the chain a cycle.
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, torch.cuda.OutOfMemoryError) or (
            "DefaultCPUAllocator: can't allocate memory" in str(cause)
        ):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


class _InPlaceViewRefused(RuntimeError):
    """An op changing a `DTensor`'s (fixed) shape in place: `transpose_`."""


class _FunctionFallbackMode(TorchFunctionMode):
    """Reruns a torch function on global values where it decomposes into
    in-place shape changes (`torch.stft`: `as_strided`, `transpose_`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except _InPlaceViewRefused as e:
            refusal = e
        name = f"torch.{getattr(func, '__name__', func)}"
        if name.endswith("_"):
            # An in-place function must return its operand, whose shape stays.
            raise refusal
        return global_values.on_global_values(
            func, args, kwargs, refusal, name, differentiable=True
        )


def _without_strided_shards(x, func):
    """`x`, an output of `func`, gathered along mesh axes where it is a strided
    shard: DTensor plans every later op on it with a slow search."""
    if not isinstance(x, DTensor):
        return x
    placements = [
        p if p.is_shard() or p.is_replicate() or p.is_partial() else Replicate()
        for p in x.placements
    ]
    if placements == list(x.placements):
        return x
    gathered = x.redistribute(x.device_mesh, placements)
    received = gathered.to_local().numel() - x.to_local().numel()
    name = f"{func} (strided shard)"
    global_values.count(name, _STRIDED_SHARD, [], received * x.element_size())
    return gathered
