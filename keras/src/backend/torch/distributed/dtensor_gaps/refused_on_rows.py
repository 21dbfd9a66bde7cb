"""Ops DTensor refuses, computed on each process' rows where per-sample
(a recurrent layer's fused cell, some pooling and resampling kernels), not
on gathered global values. The first meeting of a signature computes the op
both ways, and the processes agree whether it runs on the local rows.
"""

import dataclasses
import threading

import torch

from keras.src.backend.torch.distributed.core import collectives
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard
from keras.src.backend.torch.distributed.dtensor_gaps import global_values

# `{signature: whether the op is per-sample there}`.
_per_sample = {}
_lock = threading.Lock()
ON_ROWS = "computed on each process' rows (per-sample)"
# Results equal to float32 rounding: the same kernel on fewer rows.
RTOL = 1e-5
ATOL = 1e-6


def forget():
    """Forgets which signatures were found per-sample."""
    with _lock:
        _per_sample.clear()


def on_local_rows(func, args, kwargs, refusal):
    """The results of `func` (refused by DTensor with `refusal`) computed on
    each process' rows as batch-sharded `DTensor`s, or `None` where the op
    does not split by rows."""
    split = _batch_split(args, kwargs)
    if split is None:
        return None
    signature = _signature(func, args, kwargs, split)
    with _lock:
        known = _per_sample.get(signature)
    if known is False:
        return None
    if known:
        return _computed_on_rows(func, args, kwargs, split, counted=True)[0]
    return _first_meeting(func, args, kwargs, refusal, split, signature)


@dataclasses.dataclass(frozen=True)
class _Split:
    """How an op's operands split by rows over one mesh dimension; `rows`:
    the `id` of each operand split by rows."""

    mesh: object
    mesh_dim: int
    global_rows: int
    rows: frozenset

    def placements(self, by_rows):
        """An operand's placements: its rows if `by_rows`, else whole."""
        placements = [Replicate()] * self.mesh.ndim
        if by_rows:
            placements[self.mesh_dim] = Shard(0)
        return placements

    @property
    def local_rows(self):
        start, stop = layouts.chunk_bounds(
            self.global_rows,
            self.mesh.size(self.mesh_dim),
            self.mesh.get_local_rank(self.mesh_dim),
        )
        return stop - start


def _batch_split(args, kwargs):
    """The `_Split` of the operands, or `None`: `DTensor`s sharded on axis 0
    over one mesh dimension with equal row counts (a row or more each), any
    other operand whole over it."""
    operands = [
        x
        for x in global_values.leaves((args, kwargs))
        if isinstance(x, DTensor)
    ]
    mesh = operands[0].device_mesh
    mesh_dims = {
        d
        for x in operands
        for d, p in enumerate(x.placements)
        if type(p) is Shard and p.dim % max(x.ndim, 1) == 0 and x.ndim > 0
    }
    if len(mesh_dims) != 1:
        return None
    (mesh_dim,) = mesh_dims
    rows, global_rows = [], None
    for x in operands:
        if x.device_mesh != mesh:
            return None
        placement = x.placements[mesh_dim]
        if placement.is_replicate():
            continue
        if not (type(placement) is Shard and placement.dim % x.ndim == 0):
            return None
        if global_rows not in (None, x.shape[0]):
            return None
        global_rows = x.shape[0]
        rows.append(id(x))
    parts = mesh.size(mesh_dim)
    start, stop = layouts.chunk_bounds(global_rows, parts, parts - 1)
    if stop <= start:
        return None  # A process without rows: its kernels may refuse them.
    # A whole operand of as many rows (a gradient made whole by a sum over
    # the batch) is taken by rows too.
    rows += [
        id(x)
        for x in operands
        if x.placements[mesh_dim].is_replicate()
        and x.ndim > 0
        and x.shape[0] == global_rows
    ]
    return _Split(mesh, mesh_dim, global_rows, frozenset(rows))


def _signature(func, args, kwargs, split):
    def key(x):
        if isinstance(x, DTensor):
            shape = tuple(x.shape)
            if id(x) in split.rows:
                shape = shape[1:]
            return ("dtensor", tuple(x.placements), shape, x.dtype)
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), x.dtype)
        if isinstance(x, (bool, int, float, str, type(None), torch.dtype)):
            return x
        return type(x).__name__

    leaves = global_values.leaves((args, sorted((kwargs or {}).items())))
    # Uneven parts meet the op anew: a kernel may refuse a process' few rows.
    even = split.global_rows % split.mesh.size(split.mesh_dim) == 0
    return (func, split.mesh_dim, even, tuple(key(x) for x in leaves))


def _computed_on_rows(func, args, kwargs, split, counted=False):
    """`(DTensor results, local results)`, or `(None, None)` if a result is
    not this process' rows; `counted`: add to the fallback's counts."""
    gathered_bytes = 0

    def on_rows(x):
        nonlocal gathered_bytes
        if not isinstance(x, DTensor):
            return x
        target = split.placements(id(x) in split.rows)
        value = x.detach().redistribute(split.mesh, target)
        received = value.to_local().numel() - x.to_local().numel()
        gathered_bytes += max(0, received) * x.element_size()
        return value.to_local()

    local_args, local_kwargs = global_values.map_leaves(on_rows, (args, kwargs))
    outputs = func(*local_args, **local_kwargs)
    local_rows = split.local_rows
    results = global_values.leaves(outputs)
    if not all(
        isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] == local_rows
        for x in results
    ):
        return None, None
    if counted:
        global_values.count(str(func), ON_ROWS, [], gathered_bytes)
    placements = split.placements(True)

    def as_dtensor(x):
        shape = (split.global_rows,) + tuple(x.shape[1:])
        return layouts.dtensor_from_local(
            x.contiguous(), split.mesh, placements, shape
        )

    return global_values.map_leaves(as_dtensor, outputs), results


def _first_meeting(func, args, kwargs, refusal, split, signature):
    """Computes `func` on global values; records if it is per-sample."""
    outputs = global_values.on_global_values(
        func, args, kwargs, refusal, str(func)
    )
    try:
        on_rows, local = _computed_on_rows(func, args, kwargs, split)
    except (RuntimeError, ValueError, IndexError) as error:
        # A kernel refusing the local rows' shape: not per-sample here.
        if isinstance(error, torch.OutOfMemoryError):
            raise
        runtime.log_debug("%s on the local rows: %s", func, error)
        local = None
    agrees = _own_rows_agree(outputs, local, split)
    # Every process of the mesh takes the same path from now on.
    differs = not agrees
    for mesh_dim in range(split.mesh.ndim):
        group = split.mesh.get_group(mesh_dim)
        differs = collectives.any_process(differs, group)
    with _lock:
        _per_sample[signature] = not differs
    return outputs


def _own_rows_agree(outputs, local, split):
    """Whether `local` (`None` if the rows' call failed) holds this process'
    rows of each result. Every process redistributes the same results
    whatever its own `local`, so that their collectives pair up."""
    results = global_values.leaves(outputs)
    placements = split.placements(True)
    own = [
        x.redistribute(split.mesh, placements).to_local()
        for x in results
        if isinstance(x, DTensor)
    ]
    return (
        local is not None
        and len(own) == len(results) == len(local)
        and all(_same(a, b) for a, b in zip(own, local))
    )


def _same(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)
