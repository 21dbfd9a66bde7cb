"""Training steps of the torch trainer under a `keras.distribution`.

Each step receives the global batch (the data adapters yield global batches),
keeps this process' part of it and assembles the global batch as a DTensor
sharded on the batch axis. Gradients are reduced once per step, in buckets,
before the optimizer sees them, so the optimizer issues no collectives.
"""

import functools
import warnings
import weakref

import torch
import torch.distributed as dist

from keras.src import tree
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.torch import distribution_lib

# Gradients are all-reduced in buckets of about this many bytes, as DDP does.
BUCKET_BYTES = 25 * 1024 * 1024

# Each optimizer's flat gradient buffers, kept from one step to the next:
# allocated anew, they would cost fresh memory pages every step.
_GRADIENT_BUFFERS = weakref.WeakKeyDictionary()


def wrap_step_function(step_function, eager_step_function, model):
    """Runs a train/test/predict step function under the distribution.

    Args:
        step_function: a function of `data`, a list holding one global batch;
            possibly compiled with `torch.compile`.
        eager_step_function: the same function, not compiled.
        model: the model the step belongs to.

    Returns:
        A function of the same signature that distributes the batch, and runs
        the step with plain tensors taken as replicated global values. If the
        compiled step fails on its first call, it warns once, restores the
        state the attempt may have changed, and runs eagerly from then on.
    """
    # A compiled step is checked on its first call.
    unchecked = step_function is not eager_step_function

    @functools.wraps(eager_step_function)
    def distributed_step(data):
        nonlocal step_function, unchecked
        distribution = distribution_lib.current_distribution()
        if distribution is None:
            return step_function(data)
        data = distribute_batch(data, distribution)
        with distribution_lib.replicated_plain_tensors():
            if not unchecked:
                return step_function(data)
            unchecked = False
            try:
                return _first_compiled_step(step_function, model, data)
            except _CompileFailed:
                step_function = eager_step_function
                return eager_step_function(data)

    return distributed_step


class _CompileFailed(Exception):
    pass


def _first_compiled_step(compiled_step_function, model, data):
    """Runs the compiled step; undoes what it changed if it fails."""
    state = _step_state(model)
    saved = [v.value.detach().clone() for v in state]
    try:
        return compiled_step_function(data)
    except Exception as e:  # torch.compile raises errors of many types.
        reason = " ".join(str(e).split())[:240]
        warnings.warn(
            "`jit_compile=True`: torch.compile could not compile a step of "
            f"this distributed model ({type(e).__name__}: {reason}). "
            "Running the step eagerly instead.",
            stacklevel=3,
        )
        with torch.no_grad():
            for variable, value in zip(state, saved):
                variable.assign(value)
        model.zero_grad()
        raise _CompileFailed() from e


def _step_state(model):
    """Variables a step may change before it fails: all but the weights."""
    state = list(model.non_trainable_variables) + list(model.metrics_variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        state += list(optimizer.variables)
    unique = {id(v): v for v in state}
    return list(unique.values())


def distribute_batch(data, distribution):
    """Turns a global batch into a DTensor batch sharded on the batch axis.

    Args:
        data: nested structure of arrays or tensors; every array has the
            global batch as its leading dimension.
        distribution: the `keras.distribution.Distribution` in effect.

    Returns:
        The same structure, each array replaced by a `DTensor`.
    """
    leaves = [x for x in tree.flatten(data) if _is_batch_array(x)]
    if not leaves:
        return data
    batch_size = int(leaves[0].shape[0])
    if distribution.auto_shard_dataset:
        global_batch_size = batch_size
        start, stop = _batch_part(global_batch_size, distribution)
    else:
        # Each process was given its own part of the global batch.
        global_batch_size, start, stop = None, 0, batch_size

    def put(x):
        if not _is_batch_array(x):
            return x
        if int(x.shape[0]) != batch_size:
            raise ValueError(
                "All inputs of a batch must have the same batch size. "
                f"Received sizes {batch_size} and {int(x.shape[0])}."
            )
        layout = distribution.get_data_layout(tuple(x.shape))
        return distribution_lib.distribute_data_input(
            x[start:stop],
            layout,
            distribution.batch_dim_name,
            global_batch_size=global_batch_size,
        )

    return tree.map_structure(put, data)


def apply_gradients(apply_function, optimizer, grads, trainable_variables):
    """Runs `optimizer.apply` on distributed gradients.

    Partial gradients are first reduced once (see `reduce_gradients`). When
    every variable and gradient is replicated (data parallelism), the update
    then runs on the local tensors, which hold the whole values: the math is
    the same and skips DTensor's dispatch on every optimizer op.

    Args:
        apply_function: the optimizer's own `apply(grads, variables)`.
        optimizer: the optimizer.
        grads: list of gradients.
        trainable_variables: the variables, or `None` for the optimizer's.

    Returns:
        What `apply_function` returns.
    """
    buffers = _GRADIENT_BUFFERS.setdefault(optimizer, {})
    grads = reduce_gradients(grads, buffers=buffers)
    variables = trainable_variables
    if variables is None:
        variables = optimizer._trainable_variables
    state = list(optimizer.variables) + list(variables)
    if not (optimizer.built and _all_replicated(state + list(grads))):
        return apply_function(grads, trainable_variables)
    local_values = [(v, _local_value(v.value)) for v in state]
    with torch.no_grad():
        with StatelessScope(state_mapping=local_values) as scope:
            result = apply_function(
                [_local_value(g) for g in grads], trainable_variables
            )
        # Most updates were made in place; copy back those that were not.
        for variable, local in local_values:
            new_value = scope.get_current_value(variable)
            if new_value is not local:
                local.copy_(new_value)
    return result


def _all_replicated(values):
    for x in values:
        x = getattr(x, "value", x)
        if isinstance(x, distribution_lib.DTensor) and not all(
            p.is_replicate() for p in x.placements
        ):
            return False
    return True


def _local_value(x):
    if isinstance(x, distribution_lib.DTensor):
        return x.to_local()
    return x


def reduce_gradients(gradients, buffers=None):
    """Turns partial-sum gradients into the replicated or sharded ones.

    Gradients of replicated weights computed on a sharded batch come out of
    autograd as `Partial` DTensors; left so, every optimizer op that reads
    them would all-reduce them again. Here they are all-reduced once, packed
    into buckets of `BUCKET_BYTES`.

    Args:
        gradients: list of gradients (`DTensor`, tensor or `None`).
        buffers: optional dict in which the flat buffers the buckets are
            packed into are kept for the next call. The gradients returned
            by a call are views of these buffers: the next call with the
            same dict overwrites them.

    Returns:
        The list with every `Partial` placement reduced.
    """
    gradients = list(gradients)
    groups = {}
    for i, g in enumerate(gradients):
        if isinstance(g, distribution_lib.DTensor) and any(
            p.is_partial() for p in g.placements
        ):
            key = (id(g.device_mesh), g.placements, g.dtype, g.device)
            groups.setdefault(key, []).append(i)
    for key, indices in groups.items():
        if not _needs_reduction(gradients[indices[0]]):
            for i in indices:
                gradients[i] = _relabel_reduced(gradients[i])
            continue
        flat = _flat_buffer(buffers, key, [gradients[i] for i in indices])
        offset = 0
        for bucket in _buckets(indices, gradients):
            bucket_gradients = [gradients[i] for i in bucket]
            size = sum(g.to_local().numel() for g in bucket_gradients)
            reduced = _all_reduce_bucket(
                bucket_gradients, flat[offset : offset + size]
            )
            offset += size
            for i, g in zip(bucket, reduced):
                gradients[i] = g
    return gradients


def _flat_buffer(buffers, key, gradients):
    """A 1-D buffer for the local values of `gradients`, reused if cached."""
    size = sum(g.to_local().numel() for g in gradients)
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


def _relabel_reduced(gradient):
    """A gradient partial only over mesh axes of size one is already whole."""
    return distribution_lib.DTensor.from_local(
        gradient.to_local(),
        gradient.device_mesh,
        _reduced_placements(gradient.placements),
        run_check=False,
        shape=gradient.shape,
        stride=gradient.stride(),
    )


def _reduced_placements(placements):
    replicate = distribution_lib.Replicate()
    return [replicate if p.is_partial() else p for p in placements]


def _all_reduce_bucket(gradients, flat):
    """All-reduces gradients of one mesh, placement and dtype at once.

    Args:
        gradients: the bucket's `Partial` gradients.
        flat: a 1-D tensor of their total local size to pack them into.

    Returns:
        The reduced gradients, views of `flat`.
    """
    first = gradients[0]
    mesh, placements = first.device_mesh, first.placements
    torch.cat([g.to_local().reshape(-1) for g in gradients], out=flat)
    for mesh_dim, placement in enumerate(placements):
        if placement.is_partial() and mesh.size(mesh_dim) > 1:
            dist.all_reduce(flat, group=mesh.get_group(mesh_dim))
            if placement.reduce_op == "avg":
                flat /= mesh.size(mesh_dim)
    reduced_placements = _reduced_placements(placements)
    reduced, offset = [], 0
    for g in gradients:
        local = g.to_local()
        part = flat[offset : offset + local.numel()].view(local.shape)
        offset += local.numel()
        reduced.append(
            distribution_lib.DTensor.from_local(
                part,
                mesh,
                reduced_placements,
                run_check=False,
                shape=g.shape,
                stride=g.stride(),
            )
        )
    return reduced


def _buckets(indices, gradients):
    bucket, size = [], 0
    for i in indices:
        local = gradients[i].to_local()
        bucket.append(i)
        size += local.numel() * local.element_size()
        if size >= BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _batch_part(global_batch_size, distribution):
    """Rows `[start, stop)` of the global batch this process holds.

    The batch is split over the batch axis of the mesh like `torch.chunk`
    splits it, which is how `DTensor` shards an uneven dimension.
    """
    mesh = distribution.device_mesh.backend_mesh
    batch_dim = mesh.mesh_dim_names.index(distribution.batch_dim_name)
    num_parts = mesh.size(batch_dim)
    part = mesh.get_coordinate()[batch_dim]
    part_size = -(-global_batch_size // num_parts)
    start = min(part * part_size, global_batch_size)
    return start, min(start + part_size, global_batch_size)


def _is_batch_array(x):
    return (
        hasattr(x, "shape")
        and len(x.shape) > 0
        and not isinstance(x, distribution_lib.DTensor)
    )
