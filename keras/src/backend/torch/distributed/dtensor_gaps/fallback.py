"""Ops DTensor cannot compute, computed on global values instead.

DTensor computes an op on shards only where it has a sharding strategy
for it and accepts the placements its operands have. Where it has none
(`avg_pool2d_backward`), or refuses what it gets (an `unbind` along a
sharded dimension, a view that would split an uneven shard, an in-place
op on a partial sum), it raises, and in a Keras model that is a crash in
the middle of a training step, often in the backward pass. JAX's GSPMD
never refuses: a layout moves numbers, and every op works on every
sharding.

Here every op on `DTensor`s that runs inside a layer call or a step goes
through one torch dispatch mode. DTensor computes the op as usual; only
if it refuses, the op's `DTensor` operands are gathered to their global
values, the op runs on plain tensors as one process runs it, and each
result is laid out again (`global_values.py`). The numbers are one
process'; the price is the gathers, which `global_values.fallback_counts`
records op by op (`keras.distribution.sharding_summary` prints them).

Why a dispatch mode, and not `register_sharding`: a strategy registered
with `torch.distributed.tensor.experimental.register_sharding` replaces
DTensor's own strategy for that op, so it cannot mend an op DTensor
handles in most layouts (views, `unbind`) without losing its sharded
cases; and it must name every op in advance, while the ops a model meets
depend on its layers and layouts (backward ops included). The mode sees
every op as it runs, forward and backward alike (the autograd engine runs
the backward pass under the modes of the thread that started it), and
changes nothing where DTensor computes.

The same mode gathers the one kind of result DTensor computes on but
cannot plan for in reasonable time: a strided shard, which a view merging a
sharded dimension into an outer one leaves (see `_without_strided_shards`).
It is counted like a fallback.

DTensor decides whether it can compute an op from its operands' global
shapes and placements, the same on every process, before it
communicates: so every process falls back on the same ops, in the same
order, and the gathers pair up.
"""

import contextlib
import functools
import os
import threading
import traceback

import torch
from torch.overrides import TorchFunctionMode

# The documented base class of torch dispatch modes ("Extending PyTorch:
# Extending all torch API with Modes").
from torch.utils._python_dispatch import TorchDispatchMode

from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.dtensor_gaps import global_values
from keras.src.backend.torch.distributed.dtensor_gaps import linear_partials
from keras.src.backend.torch.distributed.dtensor_gaps import refused_on_rows
from keras.src.backend.torch.distributed.dtensor_gaps import sharded_positions

_LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default
# Reductions that return positions: a shard's own `argmax` is a position in
# the shard, which no collective of the shards' results turns into the
# global one.
_POSITION_REDUCTIONS = (
    torch.ops.aten.argmax.default,
    torch.ops.aten.argmin.default,
)


# Errors DTensor raises when it cannot compute an op on the placements it
# got: no strategy (`NotImplementedError`), a refused placement
# (`RuntimeError`, `ValueError`), an assertion in its propagation, and a
# crash of its redistribution planner (`IndexError`: torch 2.11, a padding
# of a tensor sharded on the padded dimension). See `is_refusal`.
_REFUSALS = (
    NotImplementedError,
    RuntimeError,
    ValueError,
    AssertionError,
    IndexError,
)
_DTENSOR_PACKAGE = os.path.join("torch", "distributed", "tensor", "")
# What torch's CPU allocator says when it runs out of memory (a
# `RuntimeError` of its own, where CUDA's is `torch.OutOfMemoryError`).
_CPU_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"

_state = threading.local()

# What the fallback computed on global values, op by op: counted where the
# gathers happen, read here by the summary and the tests.
fallback_counts = global_values.fallback_counts
reset_fallback_counts = global_values.reset_fallback_counts

# The reasons counted for what DTensor computes, but not as wanted.
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
    """Computes ops that DTensor refuses on global values, in this thread.

    The one way into the fallback: entered around eager layer calls and
    around a step; nested entries do nothing more. A torch dispatch mode
    costs every op some microseconds, plain tensors' too, so a step that
    may run on the local rows enters it lazily: the mode goes on at the
    step's first nested entry (a layer call through DTensor) or when the
    yielded function is called, and stays on to the step's end, so that
    its backward pass has it too. Not under `torch.compile`, which does
    not trace dispatch modes: a step it cannot compile runs eagerly.

    Args:
        lazy: whether to wait for a nested entry (a step's).

    Yields:
        A function that turns the mode on now (a no-op where it is on).
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
        if func is _LOCAL_SCALAR_DENSE and not _is_replicated(args[0]):
            # `item()`, `float()`, `bool()` of a `DTensor`: DTensor reads the
            # local value, a silently wrong number on a partial sum (`max`)
            # and a failure on the processes without a part.
            return global_values.on_global_values(
                func, args, kwargs, _LOCAL_SCALAR, str(func)
            )
        if func in _POSITION_REDUCTIONS and _reduces_a_split_dim(args, kwargs):
            # torch 2.15 computes it on each shard and labels the shard's
            # positions as a shard of the result: wrong numbers, and a
            # result whose local tensor has the wrong shape.
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
            # A plain tensor updated with a `DTensor` (`total += loss`):
            # DTensor would write into it, then refuse to return it.
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
            # Per-sample along a batch-sharded operand: on each process'
            # rows, without gathering the batch.
            outputs = refused_on_rows.on_local_rows(func, args, kwargs, refusal)
            if outputs is not None:
                return outputs
        return global_values.on_global_values(
            func, args, kwargs, refusal, str(func), mutated
        )


def is_refusal(error):
    """Whether `error` is DTensor refusing an op on these placements.

    An out-of-memory error is not (computing on global values needs more
    memory), nor an assertion that fails outside DTensor's own code (a bug
    of the code that runs the op, which a retry would hide).
    """
    cause = error
    while cause is not None:
        # DTensor's dispatch may re-raise a kernel's error as its cause.
        if isinstance(cause, torch.cuda.OutOfMemoryError) or (
            _CPU_OUT_OF_MEMORY in str(cause)
        ):
            return False
        cause = cause.__cause__ or cause.__context__
    if isinstance(error, AssertionError):
        frames = traceback.extract_tb(error.__traceback__)
        return bool(frames) and _DTENSOR_PACKAGE in frames[-1].filename
    return True


class _InPlaceViewRefused(RuntimeError):
    """An op that changes a `DTensor`'s shape in place (`transpose_`), which
    `_FallbackMode` cannot emulate: a `DTensor`'s shape is fixed."""


class _FunctionFallbackMode(TorchFunctionMode):
    """Runs a torch function on global values where DTensor cannot follow
    its decomposition.

    Some torch functions decompose, below the dispatch modes, into ops that
    change a tensor's shape in place (`torch.stft`: `as_strided`, then
    `transpose_`): `_FallbackMode` refuses those, and the outermost torch
    function (`torch.stft`) runs again as a whole, on the global values of
    its `DTensor` operands.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except _InPlaceViewRefused as e:
            refusal = e
        name = f"torch.{getattr(func, '__name__', func)}"
        if name.endswith("_"):
            # An in-place function of the caller's: its result must be the
            # operand it was given, which keeps its shape.
            raise refusal
        return global_values.on_global_values(
            func, args, kwargs, refusal, name, differentiable=True
        )


def _without_strided_shards(x, name):
    """`x`, gathered along the mesh axes where it is a strided shard.

    A view that merges a sharded dimension into an unsharded outer one
    (`(batch, heads, ...) -> (batch * heads, ...)`, heads sharded) leaves
    a shard with a stride, neither `Shard` nor `Replicate`. DTensor
    computes on it, but then plans every later op on it with a graph
    search over the placements of all mesh axes: on a 2-D mesh, minutes
    for a model's first step. Gathered along those axes, it plans as any
    other value.

    Args:
        x: an op's output.
        name: the op's name, to count the gather under.

    Returns:
        `x`, or `x` replicated along the mesh axes of its strided shards.
    """
    if not isinstance(x, DTensor):
        return x
    placements = x.placements
    if all(_is_plain(p) for p in placements):
        return x
    gathered = x.redistribute(
        x.device_mesh,
        [p if _is_plain(p) else Replicate() for p in placements],
    )
    global_values.count(
        name,
        _STRIDED_SHARD,
        [],
        (gathered.to_local().numel() - x.to_local().numel()) * x.element_size(),
    )
    return gathered


def _reduces_a_split_dim(args, kwargs):
    """Whether `argmax(x, dim)` / `argmin` reduces a dimension of `x` that
    is sharded or partial (all of them when `dim` is None)."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    for placement in x.placements:
        if placement.is_partial():
            return True
        if placement.is_shard() and (
            dim is None or placement.dim % x.ndim == dim % max(x.ndim, 1)
        ):
            return True
    return False


def _is_replicated(x):
    return all(p.is_replicate() for p in x.placements)


def _is_plain(placement):
    return (
        placement.is_shard()
        or placement.is_replicate()
        or placement.is_partial()
    )
