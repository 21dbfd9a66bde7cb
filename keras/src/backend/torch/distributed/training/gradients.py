"""Gradients reduced once per step in DDP-like buckets: replicated weights'
`Partial` gradients would be all-reduced by every optimizer op reading them."""

import math
import weakref

import torch
import torch.distributed as dist

from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import local_state
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor

BUCKET_BYTES = 25 * 1024 * 1024
# The first overlapped bucket on an accelerator is small, as DDP's: it starts
# early in backward (`first_bucket_bytes`).
FIRST_BUCKET_BYTES = 1024 * 1024

_GRADIENT_BUFFERS = weakref.WeakKeyDictionary()


def apply_gradients(apply_function, optimizer, grads, trainable_variables):
    """`apply_function` on gradients reduced once, laid out as their variables,
    and if all replicated on local tensors (no DTensor dispatch)."""
    if runtime.current_distribution() is None:
        return apply_function(grads, trainable_variables)
    variables = trainable_variables or optimizer._trainable_variables
    grads = list(grads)
    # Plain gradients (a train step's, reduced) are neither.
    plain = not any(isinstance(g, DTensor) for g in grads)
    if not plain:
        buffers = optimizer_buffers(optimizer)
        grads = _laid_out(reduce_gradients(grads, buffers=buffers), variables)
    state = list(optimizer.variables) + list(variables)
    if optimizer.built and (plain or local_state.all_replicated(grads)):
        with torch.no_grad(), local_state.local_reads(state) as local:
            if local:
                grads = [local_state.local_value(g) for g in grads]
                return apply_function(grads, trainable_variables)
    return apply_function(grads, trainable_variables)


def _laid_out(grads, variables):
    """`DTensor` `grads` redistributed as their variables, once here, not by
    every optimizer op reading them."""
    values = [getattr(v, "value", v) for v in variables]
    return [
        layouts.redistribute(g, g.device_mesh, x.placements)
        if isinstance(g, DTensor)
        and isinstance(x, DTensor)
        and g.device_mesh == x.device_mesh
        else g
        for g, x in zip(grads, values)
    ]


def optimizer_buffers(optimizer):
    """The optimizer's kept flat buffers; `None` in a compiled step (a dict
    filled on its first run would fail a guard and recompile it)."""
    if torch.compiler.is_compiling():
        return None
    return _GRADIENT_BUFFERS.setdefault(optimizer, {})


def reduce_gradients(gradients, buffers=None, as_local=False):
    """`gradients` with every `Partial` placement reduced (views of `buffers`'
    flat buffers if given); replicated ones local tensors if `as_local`."""
    gradients = list(gradients)
    parts = {
        i: (g.to_local(), g.device_mesh, tuple(g.placements))
        for i, g in enumerate(gradients)
        if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements)
    }
    for i, local in zip(parts, reduce_parts(list(parts.values()), buffers)):
        gradients[i] = reduced_value(gradients[i], local, as_local)
    return gradients


def reduce_parts(parts, buffers=None, key_prefix=()):
    """Sums `parts`' locals (`(local, mesh, placements)`) over partial axes,
    bucketing like parts; meshes keyed by value: DTensor's cache copies them."""
    reduced = [None] * len(parts)
    groups = {}
    for i, (local, mesh, placements) in enumerate(parts):
        ops = tuple(  # Else `None`, not `False`: `ReduceOp.SUM == 0 == False`.
            reduce_op(p) if p.is_partial() else None for p in placements
        )
        key = (mesh, ops, local.dtype, local.device)
        groups.setdefault(key, []).append(i)
    for key, indices in groups.items():
        _, mesh, placements = parts[indices[0]]
        # One all-reduce per partial mesh axis, or one over every process
        # when partial by one op on every non-trivial axis of the world.
        partial = [(d, placements[d]) for d in partial_dims(mesh, placements)]
        if (
            len(partial) > 1
            and len(partial) == sum(1 for n in mesh.shape if n > 1)
            and len({reduce_op(p) for _, p in partial}) == 1
            and mesh.size() == dist.get_world_size()
        ):
            reductions = [(None, reduce_op(partial[0][1]))]
        else:
            reductions = [(mesh.get_group(d), reduce_op(p)) for d, p in partial]
        sizes = buckets(indices, lambda i: parts[i][0])
        for number, bucket in enumerate(sizes):
            locals_ = [parts[i][0] for i in bucket]
            if reductions:
                bucket_key = key_prefix + key + (number,)
                flat, _ = all_reduced(locals_, reductions, buffers, bucket_key)
                locals_ = views(flat, locals_)
            for i, local in zip(bucket, locals_):
                reduced[i] = averaged(local, mesh, parts[i][2])
    return reduced


def all_reduced(locals_, reductions, buffers=None, key=None, async_op=False):
    """`(flat, work)`: `locals_` packed in one flat buffer (kept in `buffers`
    under `key`), all-reduced by each `(process group, op)` of `reductions`."""
    size = sum(x.numel() for x in locals_)
    buffers = {} if buffers is None else buffers
    flat = buffers.get(key)
    if flat is None or flat.numel() < size:
        flat = buffers[key] = locals_[0].new_empty(size)
    flat = flat[:size]
    torch.cat([x.reshape(-1) for x in locals_], out=flat)
    for group, op in reductions:
        work = dist.all_reduce(flat, op=op, group=group, async_op=async_op)
    return flat, work


def views(flat, values):
    """Views of `flat` shaped as each of `values` (their local parts)."""
    locals_ = [local_state.local_value(x) for x in values]
    parts = flat.split([x.numel() for x in locals_])
    return [part.view(x.shape) for part, x in zip(parts, locals_)]


def averaged(local, mesh, placements):
    """`local`, a sum of `placements`' partial averages, divided in place."""
    divisor = math.prod(
        mesh.size(d)
        for d, p in enumerate(placements)
        if p.is_partial() and p.reduce_op == "avg"
    )
    if divisor > 1:
        local /= divisor
    return local


def partial_dims(mesh, placements):
    """The mesh dims of more than one process `placements` are partial over."""
    return [
        d
        for d, p in enumerate(placements)
        if p.is_partial() and mesh.size(d) > 1
    ]


def reduced_value(value, local, as_local):
    """The reduced `value` whose local part is `local`: a `DTensor`, or
    `local` itself if `as_local` and the value is replicated."""
    placements = layouts.reduced_placements(value.placements)
    if as_local and all(p.is_replicate() for p in placements):
        return local
    return layouts.dtensor_from_local(
        local, value.device_mesh, placements, value.shape, value.stride()
    )


def reduce_op(placement):
    """The `ReduceOp` summing parts partial by `placement` (averages too)."""
    op = placement.reduce_op
    return getattr(dist.ReduceOp, "SUM" if op == "avg" else op.upper())


def first_bucket_bytes(mesh):
    """The first overlapped bucket's cap on `mesh`: DDP's small one on an
    accelerator, whose all-reduce runs beside backward's kernels. On CPUs
    gloo's all-reduce takes the cores backward computes on, so starting it
    early overlaps little and the extra collective costs its whole latency:
    there the first bucket is as large as the others (as DDP's is given a
    `bucket_cap_mb`)."""
    if mesh.device_type == "cpu":
        return BUCKET_BYTES
    return FIRST_BUCKET_BYTES


def buckets(items, tensor, first_cap=None):
    """`items` in consecutive buckets of at least `BUCKET_BYTES` (`first_cap`
    for the first) of `tensor(item)`s, as DDP's reducer."""
    result, bucket, size = [], [], 0
    for item in items:
        bucket.append(item)
        size += tensor(item).nbytes
        if size >= (BUCKET_BYTES if first_cap is None or result else first_cap):
            result.append(bucket)
            bucket, size = [], 0
    return result + [bucket] if bucket else result
