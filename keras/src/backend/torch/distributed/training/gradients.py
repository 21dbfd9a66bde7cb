"""Gradients reduced once per step, in buckets, before the optimizer.

Replicated weights' gradients on a sharded batch are `Partial` DTensors, which
every optimizer op reading them would all-reduce again; here each is reduced
once, in DDP-like buckets. `buckets` and `all_reduced` are the one
bucketing and packing of every gradient sum: `reduce_parts`' (the step's
last bucket, an optimizer's `apply`, FSDP's sums over the mesh axes a
weight is replicated on) and the buckets `step_reduction` launches during
the backward pass.
"""

import weakref

import torch
import torch.distributed as dist

from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import local_state
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Partial

BUCKET_BYTES = 25 * 1024 * 1024
# The first overlapped bucket is small, as DDP's: it starts early in backward.
FIRST_BUCKET_BYTES = 1024 * 1024

# Each optimizer's flat gradient buffers, kept across steps to reuse memory.
_GRADIENT_BUFFERS = weakref.WeakKeyDictionary()


def apply_gradients(apply_function, optimizer, grads, trainable_variables):
    """The optimizer's own `apply_function(grads, variables)` on gradients
    reduced once; on local tensors when all is replicated, skipping DTensor's
    dispatch, each variable holding its own (assigned in place, as without a
    distribution: an optimizer reading a value before assigning it sees the
    new one, as upstream does). `trainable_variables` `None`: the
    optimizer's."""
    if runtime.current_distribution() is None:
        return apply_function(grads, trainable_variables)
    grads = reduce_gradients(grads, buffers=optimizer_buffers(optimizer))
    variables = trainable_variables
    if variables is None:
        variables = optimizer._trainable_variables
    grads = laid_out_as(grads, variables)
    state = list(optimizer.variables) + list(variables)
    if not (
        optimizer.built and local_state.all_replicated(state + list(grads))
    ):
        return apply_function(grads, trainable_variables)
    with torch.no_grad(), local_state.local_reads(state):
        return apply_function(
            [local_state.local_value(g) for g in grads], trainable_variables
        )


def laid_out_as(gradients, variables):
    """Each gradient redistributed once to its variable's layout (autograd's
    can differ), not by every optimizer op reading it."""
    laid_out = []
    for g, v in zip(gradients, variables):
        value = getattr(v, "value", v)
        if (
            isinstance(g, DTensor)
            and isinstance(value, DTensor)
            and g.device_mesh == value.device_mesh
            and not any(p.is_partial() for p in g.placements)
        ):
            g = layouts.redistribute(g, g.device_mesh, value.placements)
        laid_out.append(g)
    return laid_out


def reduces_to_replicated(values):
    """Whether every `DTensor` in `values` is replicated once reduced."""
    return all(
        all(p.is_partial() or p.is_replicate() for p in x.placements)
        for x in values
        if isinstance(x, DTensor)
    )


def optimizer_buffers(optimizer):
    """The optimizer's kept flat buffers; `None` in a compiled step (a dict
    filled on its first run would fail a guard and recompile it)."""
    if torch.compiler.is_compiling():
        return None
    return _GRADIENT_BUFFERS.setdefault(optimizer, {})


def reduce_gradients(gradients, buffers=None, as_local=False):
    """`gradients` with every `Partial` placement reduced (`reduce_parts`).
    Results are views of the flat buffers kept in `buffers` if given,
    overwritten by the next call; replicated ones are local tensors if
    `as_local`."""
    gradients = list(gradients)
    indices = [
        i
        for i, g in enumerate(gradients)
        if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements)
    ]
    parts = [
        (g.to_local(), g.device_mesh, tuple(g.placements))
        for g in (gradients[i] for i in indices)
    ]
    for i, local in zip(indices, reduce_parts(parts, buffers)):
        gradients[i] = reduced_value(gradients[i], local, as_local)
    return gradients


def reduce_parts(parts, buffers=None, key_prefix=()):
    """The local tensors of `parts`, `(local tensor, mesh, placements)` each,
    summed over their partial mesh axes (averages summed, then divided).

    One bucketing for every reduction: parts of one mesh and dtype, partial
    over the same axes whatever their layout elsewhere, share buckets, each
    all-reduced flat. Processes differing only on those axes hold the same
    part. Meshes are keyed by value, not identity: DTensor's sharding
    propagation cache hands out an earlier, equal mesh object.
    """
    reduced = [None] * len(parts)
    groups = {}
    for i, (local, mesh, placements) in enumerate(parts):
        axes = tuple(_summed(p) if p.is_partial() else None for p in placements)
        key = (mesh, axes, local.dtype, local.device)
        groups.setdefault(key, []).append(i)
    for key, indices in groups.items():
        _, mesh, placements = parts[indices[0]]
        reductions = _all_reduces(mesh, placements)
        sizes = buckets(indices, lambda i: _local_nbytes(parts[i][0]))
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
    """`locals_` packed in one flat buffer (kept in `buffers` under `key` if
    given) and all-reduced by each `(process group, op)` of `reductions` in
    turn: `(flat, work)`, `work` the last collective's if `async_op`."""
    flat = flat_buffer(buffers, key, locals_)
    torch.cat([x.reshape(-1) for x in locals_], out=flat)
    work = None
    for group, op in reductions:
        work = dist.all_reduce(flat, op=op, group=group, async_op=async_op)
    return flat, work


def views(flat, values):
    """Views of `flat` shaped as each of `values` (their local parts)."""
    locals_ = [local_state.local_value(x) for x in values]
    parts = flat.split([x.numel() for x in locals_])
    return [part.view(x.shape) for part, x in zip(parts, locals_)]


def averaged(local, mesh, placements):
    """`local`, a sum over `placements`' partial averages, divided in place
    by the number of parts summed."""
    divisor = 1
    for d, p in enumerate(placements):
        if p.is_partial() and p.reduce_op == "avg":
            divisor *= mesh.size(d)
    if divisor > 1:
        local /= divisor
    return local


def _summed(placement):
    """`placement`, a partial average taken as a partial sum."""
    if placement.is_partial() and placement.reduce_op == "avg":
        return Partial("sum")
    return placement


def partial_dims(mesh, placements):
    """The mesh dims `placements` are partial over, of more than one
    process."""
    return [
        d
        for d, p in enumerate(placements)
        if p.is_partial() and mesh.size(d) > 1
    ]


def flat_buffer(buffers, key, values):
    """A 1-D buffer for the local values of `values`, reused if cached."""
    size = sum(local_state.local_value(x).numel() for x in values)
    first = values[0]
    buffer = None if buffers is None else buffers.get(key)
    if buffer is None or buffer.numel() < size:
        buffer = torch.empty(size, dtype=first.dtype, device=first.device)
        if buffers is not None:
            buffers[key] = buffer
    return buffer[:size]


def reduced_value(value, local, as_local):
    """The reduced `value` whose local part is `local`: a `DTensor`, or
    `local` itself if `as_local` and the value is replicated."""
    placements = layouts.reduced_placements(value.placements)
    if as_local and all(p.is_replicate() for p in placements):
        return local
    return layouts.dtensor_from_local(
        local,
        value.device_mesh,
        placements,
        shape=value.shape,
        stride=value.stride(),
    )


def _all_reduces(mesh, placements):
    """`(process group, op)` of each all-reduce summing parts partial over
    `placements`: one per partial mesh axis, or one over every process when
    partial by one op on every non-trivial axis of a whole-world mesh."""
    partial = [(d, placements[d]) for d in partial_dims(mesh, placements)]
    if (
        len(partial) > 1
        and len(partial) == sum(1 for n in mesh.shape if n > 1)
        and len({_summed(p) for _, p in partial}) == 1
        and mesh.size() == dist.get_world_size()
    ):
        return [(None, reduce_op(partial[0][1]))]
    return [(mesh.get_group(dim), reduce_op(p)) for dim, p in partial]


def reduce_op(placement):
    return getattr(dist.ReduceOp, _summed(placement).reduce_op.upper())


def unpack_bucket(gradients, flat, as_local):
    """The reduced values of a bucket's `gradients` (`DTensor`s), views of
    `flat`, partial averages divided."""
    return [
        reduced_value(g, averaged(local, g.device_mesh, g.placements), as_local)
        for g, local in zip(gradients, views(flat, gradients))
    ]


def buckets(items, nbytes, first_cap=None):
    """`items` in consecutive buckets of at least `BUCKET_BYTES` (`first_cap`
    for the first), as DDP's reducer; `nbytes(item)` is an item's size."""
    result, bucket, size = [], [], 0
    for item in items:
        bucket.append(item)
        size += nbytes(item)
        cap = BUCKET_BYTES if first_cap is None or result else first_cap
        if size >= cap:
            result.append(bucket)
            bucket, size = [], 0
    if bucket:
        result.append(bucket)
    return result


def _local_nbytes(local):
    return local.numel() * local.element_size()
