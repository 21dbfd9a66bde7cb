"""Gradients reduced once per step, in buckets, before the optimizer.

Replicated weights' gradients on a sharded batch are `Partial` DTensors, which
every optimizer op reading them would all-reduce again; here each is reduced
once, in DDP-like buckets.
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
    dispatch. `trainable_variables` `None`: the optimizer's."""
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
    with torch.no_grad(), local_state.on_local_values(state):
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
    """`gradients` with every `Partial` placement reduced, in buckets shared by
    values of one mesh and dtype partial over the same axes, whatever their
    layout elsewhere (averages summed, then divided). Results are views of the
    flat buffers kept in `buffers` if given, overwritten by the next call;
    replicated ones are local tensors if `as_local`."""
    gradients = list(gradients)
    groups = {}
    for i, g in enumerate(gradients):
        if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):
            # By the mesh's value, not its identity (DTensor's sharding
            # propagation cache hands out an earlier, equal mesh object), and
            # the axes summed over: processes differing only on those hold
            # the same part, however it is laid out on the others.
            axes = tuple(
                _summed(p) if p.is_partial() else None for p in g.placements
            )
            key = (g.device_mesh, axes, g.dtype, g.device)
            groups.setdefault(key, []).append(i)
    for key, indices in groups.items():
        if not partial_dims(gradients[indices[0]]):
            # Partial only over mesh axes of size one: already whole.
            for i in indices:
                g = gradients[i]
                gradients[i] = reduced_value(g, g.to_local(), as_local)
            continue
        flat = flat_buffer(buffers, key, [gradients[i] for i in indices])
        offset = 0
        for bucket in buckets(indices, lambda i: nbytes(gradients[i])):
            values = [gradients[i] for i in bucket]
            size = sum(g.to_local().numel() for g in values)
            part = flat[offset : offset + size]
            offset += size
            torch.cat([g.to_local().reshape(-1) for g in values], out=part)
            for group, op in _all_reduces(values[0]):
                dist.all_reduce(part, op=op, group=group)
            for i, g in zip(bucket, unpack_bucket(values, part, as_local)):
                gradients[i] = g
    return gradients


def _summed(placement):
    """`placement`, a partial average taken as a partial sum."""
    if placement.is_partial() and placement.reduce_op == "avg":
        return Partial("sum")
    return placement


def partial_dims(value):
    """The mesh dims `value` is partial over, of more than one process."""
    mesh = value.device_mesh
    return [
        d
        for d, p in enumerate(value.placements)
        if p.is_partial() and mesh.size(d) > 1
    ]


def flat_buffer(buffers, key, gradients):
    """A 1-D buffer for the local values of `gradients`, reused if cached."""
    size = sum(local_state.local_value(g).numel() for g in gradients)
    first = gradients[0]
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


def _all_reduces(value):
    """`(process group, op)` of each all-reduce summing `value`'s parts: one
    per partial mesh axis, or one over every process when it is partial by
    one op on every non-trivial axis of a whole-world mesh."""
    mesh = value.device_mesh
    partial = [(d, value.placements[d]) for d in partial_dims(value)]
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
    """The reduced values of a bucket's `gradients`, views of `flat`; partial
    averages are divided by the number of parts summed."""
    reduced, offset = [], 0
    for g in gradients:
        local = g.to_local()
        part = flat[offset : offset + local.numel()].view(local.shape)
        offset += local.numel()
        divisor = 1
        for d, p in enumerate(g.placements):
            if p.is_partial() and p.reduce_op == "avg":
                divisor *= g.device_mesh.size(d)
        if divisor > 1:
            part /= divisor
        reduced.append(reduced_value(g, part, as_local))
    return reduced


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


def nbytes(value):
    """The bytes of a value's local part."""
    with torch.no_grad():
        local = local_state.local_value(value)
    return local.numel() * local.element_size()
