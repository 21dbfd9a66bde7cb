"""Ops DTensor refuses, computed on global values instead.

DTensor raises where it has no sharding strategy for an op or refuses its
placements (`unbind` of a sharded dim, an in-place op on a partial sum);
JAX's GSPMD computes every op on every sharding. A torch dispatch mode around
layer calls and steps computes refused ops on gathered operands
(`global_values`); unlike `register_sharding`, it sees every op as it runs,
backward included. DTensor refuses from global shapes and placements, so every
process falls back alike and the gathers pair up.
"""

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
# Reductions that return positions: a shard's `argmax` is a position in the
# shard, which no collective of the shards' results makes global.
_POSITION_REDUCTIONS = (
    torch.ops.aten.argmax.default,
    torch.ops.aten.argmin.default,
)


# What DTensor raises when it cannot compute an op on these placements (an
# `IndexError`: its planner padding a sharded dim, torch 2.11).
_REFUSALS = (
    NotImplementedError,
    RuntimeError,
    ValueError,
    AssertionError,
    IndexError,
)
_DTENSOR_PACKAGE = os.path.join("torch", "distributed", "tensor", "")
# The CPU allocator's out-of-memory message (a plain `RuntimeError`).
_CPU_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"

_state = threading.local()

fallback_counts = global_values.fallback_counts
reset_fallback_counts = global_values.reset_fallback_counts

# Reasons counted for what DTensor computes, but not as wanted.
_STRIDED_SHARD = (
    "a strided shard (a view merging a sharded dimension into an outer one), "
    "gathered along its mesh axes"
)
_SPLIT_POSITIONS = (
    "positions (argmax, argmin) taken over a sharded dimension, which "
    "torch 2.15 takes per shard"
)
_LOCAL_SCALAR = (
    "a number read from a partial sum or a shard, where DTensor reads this "
    "process' part (pytorch/pytorch#166638)"
)


@contextlib.contextmanager
def dtensor_fallback(lazy=False):
    """Computes ops DTensor refuses on global values, in this thread;
    nothing more when nested nor under `torch.compile` (no dispatch modes).

    With `lazy` (a step that may run on local rows) the modes, which cost
    every op, go on at the first nested entry or when the yielded function
    is called, and stay on to the step's end for backward.
    """
    entered = getattr(_state, "lazy_step", None)
    if _active() or torch.compiler.is_compiling():
        yield _on_already
    elif entered is not None:
        _enter_modes(entered)
        yield _on_already
    elif lazy:
        _state.lazy_step = entered = []
        try:
            yield functools.partial(_enter_modes, entered)
        finally:
            _state.lazy_step = None
            for mode in reversed(entered):
                mode.__exit__(None, None, None)
    else:
        _state.active = True
        try:
            with _FunctionFallbackMode(), _FallbackMode():
                yield _on_already
        finally:
            _state.active = False


def _on_already():
    """The mode is on already: nothing to turn on."""


def _enter_modes(entered):
    """Enters the modes for the rest of a lazy step, once."""
    if entered or torch.compiler.is_compiling():
        return
    for mode in (_FunctionFallbackMode(), _FallbackMode()):
        mode.__enter__()
        entered.append(mode)


def _active():
    return getattr(_state, "active", False) or bool(
        getattr(_state, "lazy_step", None)
    )


class _FallbackMode(TorchDispatchMode):
    """Runs each op as DTensor does, on global values where it refuses."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not any(issubclass(t, DTensor) for t in types):
            return func(*args, **kwargs)
        if func is _LOCAL_SCALAR_DENSE and not all(
            p.is_replicate() for p in args[0].placements
        ):
            # `item()`, `bool()`: DTensor reads the local value, wrong on a
            # partial sum, failing on processes without a part.
            return global_values.on_global_values(
                func, args, kwargs, _LOCAL_SCALAR, str(func)
            )
        if func in _POSITION_REDUCTIONS and _reduces_a_split_dim(args, kwargs):
            # torch 2.15 labels each shard's positions a shard of the result.
            result = sharded_positions.positions(func, args, kwargs)
            if result is not None:
                return result
            return global_values.on_global_values(
                func, args, kwargs, _SPLIT_POSITIONS, str(func)
            )
        result = linear_partials.on_partial_sums(func, args, kwargs)
        if result is not None:
            return result
        mutated = global_values.mutated_operands(func, args, kwargs)
        if any(not isinstance(x, DTensor) for x in mutated):
            # `plain += dtensor`: DTensor writes, then refuses to return it.
            return global_values.on_global_values(
                func, args, kwargs, None, str(func), mutated
            )
        try:
            outputs = func(*args, **kwargs)
        except torch.distributed.DistError:
            raise
        except _REFUSALS as e:
            if not is_refusal(e):
                raise
            refusal = e
        else:
            if mutated:
                return outputs
            return global_values.map_leaves(
                functools.partial(
                    _without_strided_shards, name=f"{func} (strided shard)"
                ),
                outputs,
            )
        if torch.Tag.inplace_view in func.tags:
            raise _InPlaceViewRefused(
                f"{func} changes the shape of a DTensor in place, which "
                "DTensor cannot do on these placements."
            ) from refusal
        if not mutated:
            # Per-sample along a batch-sharded operand: on local rows.
            outputs = refused_on_rows.on_local_rows(func, args, kwargs, refusal)
            if outputs is not None:
                return outputs
        return global_values.on_global_values(
            func, args, kwargs, refusal, str(func), mutated
        )


def is_refusal(error):
    """Whether `error` is DTensor refusing an op on these placements: not
    out of memory (global values need more) nor an assertion outside DTensor
    (a bug a retry would hide)."""
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
            _CPU_OUT_OF_MEMORY in str(cause)
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


def _without_strided_shards(x, name):
    """`x` gathered (counted under `name`) along mesh axes where it is a
    strided shard: DTensor plans every later op on it with a slow search."""
    if not isinstance(x, DTensor):
        return x
    placements = x.placements
    if all(_is_plain(p) for p in placements):
        return x
    gathered = x.redistribute(
        x.device_mesh, [p if _is_plain(p) else Replicate() for p in placements]
    )
    global_values.count(
        name,
        _STRIDED_SHARD,
        [],
        (gathered.to_local().numel() - x.to_local().numel()) * x.element_size(),
    )
    return gathered


def _reduces_a_split_dim(args, kwargs):
    """Whether `argmax(x, dim)` / `argmin` reduces a sharded or partial
    dimension of `x` (all of them when `dim` is None)."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return any(
        p.is_partial()
        or (
            p.is_shard()
            and (dim is None or p.dim % x.ndim == dim % max(x.ndim, 1))
        )
        for p in x.placements
    )


def _is_plain(placement):
    return (
        placement.is_shard()
        or placement.is_replicate()
        or placement.is_partial()
    )
