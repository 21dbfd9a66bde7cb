"""Gradients reduced once per step, in buckets, before the optimizer.

Replicated weights' gradients on a sharded batch are `Partial` DTensors, which
every optimizer op reading them would all-reduce again. Here each is reduced
once, in DDP-like buckets; in Keras' train step, during backward
(`step_reduction`).
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
            # By the mesh's value, not its identity: DTensor's sharding
            # propagation cache hands out the mesh object of an earlier,
            # equal mesh.
            key = (g.device_mesh, _reduced_axes(g), g.dtype, g.device)
            groups.setdefault(key, []).append(i)
    for key, indices in groups.items():
        if not _needs_reduction(gradients[indices[0]]):
            for i in indices:
                gradients[i] = _relabel_reduced(gradients[i], as_local)
            continue
        flat = flat_buffer(buffers, key, [gradients[i] for i in indices])
        offset = 0
        for bucket in buckets(indices, lambda i: nbytes(gradients[i])):
            bucket_gradients = [gradients[i] for i in bucket]
            size = sum(g.to_local().numel() for g in bucket_gradients)
            reduced = _all_reduce_bucket(
                bucket_gradients, flat[offset : offset + size], as_local
            )
            offset += size
            for i, g in zip(bucket, reduced):
                gradients[i] = g
    return gradients


def _reduced_axes(value):
    """The placements `value` is all-reduced over, as sums. Processes that
    differ only on such an axis hold the same part of the value, however it
    is laid out on the others, so such values can share one collective."""
    return tuple(
        _summed([p])[0] if p.is_partial() else None for p in value.placements
    )


def _summed(placements):
    """`placements` with partial averages taken as partial sums."""
    return tuple(
        Partial("sum") if p.is_partial() and p.reduce_op == "avg" else p
        for p in placements
    )


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


def _needs_reduction(gradient):
    """Whether a partial gradient is partial over more than one process."""
    mesh = gradient.device_mesh
    return any(
        p.is_partial() and mesh.size(d) > 1
        for d, p in enumerate(gradient.placements)
    )


def _relabel_reduced(gradient, as_local):
    """A gradient partial only over mesh axes of size one is already whole."""
    return reduced_value(gradient, gradient.to_local(), as_local)


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


def _all_reduce_bucket(gradients, flat, as_local):
    """All-reduces a bucket (one mesh, summed placements, dtype) packed in
    `flat`, a 1-D tensor of its local size; returns views of `flat`."""
    torch.cat([g.to_local().reshape(-1) for g in gradients], out=flat)
    for group, op in _all_reduces(gradients[0]):
        dist.all_reduce(flat, op=op, group=group)
    return unpack_bucket(gradients, flat, as_local)


def _all_reduces(value):
    """`(process group, op)` of each all-reduce summing `value`'s parts: one
    per partial mesh axis, or one over every process when it is partial by
    one op on every non-trivial axis of a whole-world mesh."""
    mesh = value.device_mesh
    partial = [
        (dim, p)
        for dim, p in enumerate(value.placements)
        if p.is_partial() and mesh.size(dim) > 1
    ]
    every_axis = len(partial) == sum(1 for n in mesh.shape if n > 1)
    if (
        len(partial) > 1
        and every_axis
        and len({_summed([p])[0] for _, p in partial}) == 1
        and mesh.size() == dist.get_world_size()
    ):
        return [(None, reduce_op(partial[0][1]))]
    return [(mesh.get_group(dim), reduce_op(p)) for dim, p in partial]


def reduce_op(placement):
    return getattr(dist.ReduceOp, _summed([placement])[0].reduce_op.upper())


def unpack_bucket(gradients, flat, as_local):
    """The reduced values of a bucket's `gradients`, views of `flat`."""
    reduced, offset = [], 0
    for g in gradients:
        local = g.to_local()
        part = flat[offset : offset + local.numel()].view(local.shape)
        offset += local.numel()
        divisor = _average_divisor(g)
        if divisor > 1:
            part /= divisor
        reduced.append(reduced_value(g, part, as_local))
    return reduced


def _average_divisor(value):
    """The number of parts a partial average of `value` was summed over."""
    divisor = 1
    for mesh_dim, placement in enumerate(value.placements):
        if placement.is_partial() and placement.reduce_op == "avg":
            divisor *= value.device_mesh.size(mesh_dim)
    return divisor


def buckets(items, nbytes, first_cap=None):
    """`items` in consecutive buckets of at least `BUCKET_BYTES` (`first_cap`
    for the first), as DDP's reducer; `nbytes(item)` is an item's size."""
    result, bucket, size = [], [], 0
    for item in items:
        bucket.append(item)
        size += nbytes(item)
        cap = first_cap if first_cap is not None and not result else None
        if size >= (BUCKET_BYTES if cap is None else cap):
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
