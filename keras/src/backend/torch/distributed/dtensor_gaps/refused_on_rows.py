"""Refused ops computed on each process' rows where per-sample (a fused RNN
cell, some pooling kernels): a signature's first meeting computes the op both
ways, and the processes agree whether it runs on the local rows."""

import collections

import torch

from keras.src.backend.torch.distributed.core import collectives
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard
from keras.src.backend.torch.distributed.dtensor_gaps import global_values

# `{signature: whether the op is per-sample there}`; each access is atomic.
_per_sample = {}
ON_ROWS = "computed on each process' rows (per-sample)"


def forget():
    """Forgets which signatures were found per-sample."""
    _per_sample.clear()


def on_local_rows(func, args, kwargs, refusal):
    """`func`'s results (refused with `refusal`) from each process' rows, as
    batch-sharded `DTensor`s (at first on global values); `None` if not so."""
    split = _batch_split(args, kwargs)
    if split is None:
        return None
    signature = _signature(func, args, kwargs, split)
    known = _per_sample.get(signature)
    if known is False:
        return None
    if known:
        return _computed_on_rows(func, args, kwargs, split, counted=True)[0]
    outputs = global_values.on_global_values(
        func, args, kwargs, refusal, str(func)
    )
    try:
        local = _computed_on_rows(func, args, kwargs, split)[1]
    except (RuntimeError, ValueError, IndexError) as error:
        # A kernel refusing the local rows' shape: not per-sample here.
        if isinstance(error, torch.OutOfMemoryError):
            raise
        runtime.log_debug("%s on the local rows: %s", func, error)
        local = None
    # Alike on every process, whatever its `local`: the collectives pair up.
    results = global_values.leaves(outputs)
    own = [
        x.redistribute(split.mesh, split.by_rows).to_local()
        for x in results
        if isinstance(x, DTensor)
    ]
    differs = not (
        local is not None
        and len(own) == len(results) == len(local)
        and all(_same(a, b) for a, b in zip(own, local))
    )
    # Every process of the mesh takes the same path from now on.
    for group in (split.mesh.get_group(d) for d in range(split.mesh.ndim)):
        differs = collectives.any_process(differs, group)
    _per_sample[signature] = not differs
    return outputs


# Operands split by rows on `mesh_dim`: `rows` their ids, `by_rows` placements.
_Split = collections.namedtuple(
    "_Split", "mesh mesh_dim global_rows local_rows rows by_rows"
)


def _batch_split(args, kwargs):
    """The `_Split` of the operands, or `None`: `DTensor`s sharded on axis 0
    over one mesh dim, equal row counts (a row or more each), others whole."""
    operands = global_values.leaves((args, kwargs))
    operands = [x for x in operands if isinstance(x, DTensor)]
    mesh = operands[0].device_mesh

    def by_rows(x, mesh_dim):
        p = x.placements[mesh_dim]
        return x.ndim > 0 and type(p) is Shard and p.dim % x.ndim == 0

    mesh_dims = {
        d for x in operands for d in range(len(x.placements)) if by_rows(x, d)
    }
    if len(mesh_dims) != 1 or any(x.device_mesh != mesh for x in operands):
        return None
    (mesh_dim,) = mesh_dims
    split = [x for x in operands if not x.placements[mesh_dim].is_replicate()]
    if not all(by_rows(x, mesh_dim) for x in split) or (
        len({x.shape[0] for x in split}) != 1
    ):
        return None
    global_rows, parts = split[0].shape[0], mesh.size(mesh_dim)
    if layouts.chunk_bounds(global_rows, parts, parts - 1)[0] == global_rows:
        return None  # A process without rows: its kernels may refuse them.
    # Also by rows: a whole operand of as many rows (a batch-summed gradient).
    rows = [id(x) for x in operands if x.ndim > 0 and x.shape[0] == global_rows]
    start, stop = layouts.chunk_bounds(
        global_rows, parts, mesh.get_local_rank(mesh_dim)
    )
    placements = [Replicate()] * mesh.ndim
    placements[mesh_dim] = Shard(0)
    return _Split(
        mesh, mesh_dim, global_rows, stop - start, frozenset(rows), placements
    )


def _signature(func, args, kwargs, split):
    """What decides whether `func` is per-sample: operands' kinds, shapes
    without the rows, placements, dtypes, and whether the rows split evenly."""

    def key(x):
        if isinstance(x, DTensor):
            shape = tuple(x.shape[1:] if id(x) in split.rows else x.shape)
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
        whole = [Replicate()] * split.mesh.ndim
        target = split.by_rows if id(x) in split.rows else whole
        value = x.detach().redistribute(split.mesh, target)
        received = value.to_local().numel() - x.to_local().numel()
        gathered_bytes += max(0, received) * x.element_size()
        return value.to_local()

    local_args, local_kwargs = global_values.map_leaves(on_rows, (args, kwargs))
    outputs = func(*local_args, **local_kwargs)
    results = global_values.leaves(outputs)
    if not all(
        isinstance(x, torch.Tensor)
        and x.ndim > 0
        and x.shape[0] == split.local_rows
        for x in results
    ):
        return None, None
    if counted:
        global_values.count(str(func), ON_ROWS, [], gathered_bytes)

    def as_dtensor(x):
        shape = (split.global_rows,) + tuple(x.shape[1:])
        return layouts.dtensor_from_local(
            x.contiguous(), split.mesh, split.by_rows, shape
        )

    return global_values.map_leaves(as_dtensor, outputs), results


def _same(a, b):
    """Whether `a` equals `b`, floats to float32 rounding (fewer rows)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    return torch.equal(a, b)
