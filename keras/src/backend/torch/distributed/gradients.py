"""Gradients reduced once per step, in buckets, before the optimizer.

Gradients of replicated weights computed on a sharded batch come out of
autograd as partial sums (`Partial` DTensors). Left so, every optimizer op
that reads one would all-reduce it again; here each is all-reduced once, in
buckets of about `BUCKET_BYTES`, as DDP does, and the optimizer issues no
collectives.

In Keras' own train step the buckets are all-reduced while the backward
pass runs, as DDP's reducer does (`overlapped_reduction`): the variables
are grouped in reverse order, the order in which the backward pass
produces their gradients, the first bucket small; a bucket's all-reduce is
launched asynchronously as soon as its last gradient is accumulated. The
last bucket is complete only when the backward pass ends: it is reduced
with the loss in `reduce_with_loss`, after the others are waited for, so a
step issues one collective per bucket.
"""

import contextlib
import datetime
import functools
import weakref

import torch
import torch.distributed as dist

from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.torch.distributed import health
from keras.src.backend.torch.distributed import layouts
from keras.src.backend.torch.distributed import runtime
from keras.src.backend.torch.distributed.runtime import DTensor

if runtime.DTENSOR_AVAILABLE:
    from torch.distributed.tensor import Partial

BUCKET_BYTES = 25 * 1024 * 1024
# The first bucket of an overlapped reduction is small, as DDP's (1 MiB):
# its all-reduce starts early in the backward pass.
FIRST_BUCKET_BYTES = 1024 * 1024

# Each optimizer's flat gradient buffers, kept from one step to the next:
# allocated anew, they would cost fresh memory pages every step.
_GRADIENT_BUFFERS = weakref.WeakKeyDictionary()


def apply_gradients(apply_function, optimizer, grads, trainable_variables):
    """Runs `optimizer.apply` on distributed gradients.

    Partial gradients are first reduced once (see `reduce_gradients`). When
    every variable and gradient is replicated (data parallelism), the update
    then runs on the local tensors, which hold the whole values: the math is
    the same and skips DTensor's dispatch on every optimizer op. Without a
    distribution, `apply_function` runs as it is.

    Args:
        apply_function: the optimizer's own `apply(grads, variables)`.
        optimizer: the optimizer.
        grads: list of gradients.
        trainable_variables: the variables, or `None` for the optimizer's.

    Returns:
        What `apply_function` returns.
    """
    if runtime.current_distribution() is None:
        return apply_function(grads, trainable_variables)
    grads = reduce_gradients(grads, buffers=_buffers(optimizer))
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


def reduce_with_loss(optimizer, gradients, loss):
    """Reduces a train step's gradients and its loss in one collective.

    Under data parallelism the loss is a partial value (each process' share
    of the global batch's loss); it is reduced in the gradients' first
    bucket instead of by a collective of its own. Without a distribution,
    or with nothing to reduce, the arguments come back as they are.

    Args:
        optimizer: the optimizer the gradients are for (its flat buffers
            are reused).
        gradients: list of gradients (`DTensor`, tensor or `None`).
        loss: the step's loss.

    Returns:
        A tuple `(gradients, loss)`, reduced as `reduce_gradients` does.
    """
    if runtime.current_distribution() is None:
        return gradients, loss
    gradients = _finish_overlapped(gradients)
    # The loss goes first: it is in the first bucket whatever its size.
    reduced = reduce_gradients(
        [loss.detach()] + list(gradients), _buffers(optimizer)
    )
    return reduced[1:], reduced[0]


def _buffers(optimizer):
    """The optimizer's kept flat buffers; none in a compiled step.

    Compiled, the buffers are the graph's own: a dict filled on the first
    step would fail a guard on the second and compile the step again.
    """
    if torch.compiler.is_compiling():
        return None
    return _GRADIENT_BUFFERS.setdefault(optimizer, {})


def reduce_gradients(gradients, buffers=None):
    """Turns partial-sum gradients into the replicated or sharded ones.

    Partial sums and partial averages of one mesh and dtype share buckets:
    each bucket is summed once, and an average's part is then divided.

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
        if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):
            key = (id(g.device_mesh), _summed(g.placements), g.dtype, g.device)
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


def _summed(placements):
    """`placements` with partial averages taken as partial sums."""
    return tuple(
        Partial("sum") if p.is_partial() and p.reduce_op == "avg" else p
        for p in placements
    )


def _all_replicated(values):
    for x in values:
        x = getattr(x, "value", x)
        if isinstance(x, DTensor) and not all(
            p.is_replicate() for p in x.placements
        ):
            return False
    return True


def _local_value(x):
    return x.to_local() if isinstance(x, DTensor) else x


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
    return layouts.dtensor_from_local(
        gradient.to_local(),
        gradient.device_mesh,
        layouts.reduced_placements(gradient.placements),
        shape=gradient.shape,
        stride=gradient.stride(),
    )


def _all_reduce_bucket(gradients, flat):
    """All-reduces values of one mesh, summed placements and dtype at once.

    Args:
        gradients: the bucket's `Partial` values (sums or averages).
        flat: a 1-D tensor of their total local size to pack them into.

    Returns:
        The reduced values, views of `flat`.
    """
    first = gradients[0]
    mesh = first.device_mesh
    torch.cat([g.to_local().reshape(-1) for g in gradients], out=flat)
    for mesh_dim, placement in enumerate(first.placements):
        if placement.is_partial() and mesh.size(mesh_dim) > 1:
            dist.all_reduce(
                flat, op=_reduce_op(placement), group=mesh.get_group(mesh_dim)
            )
    return _unpack_bucket(gradients, flat)


def _reduce_op(placement):
    return getattr(dist.ReduceOp, _summed([placement])[0].reduce_op.upper())


def _unpack_bucket(gradients, flat):
    """The reduced values of a bucket's `gradients`, views of `flat`."""
    mesh = gradients[0].device_mesh
    reduced, offset = [], 0
    for g in gradients:
        local = g.to_local()
        part = flat[offset : offset + local.numel()].view(local.shape)
        offset += local.numel()
        divisor = _average_divisor(g)
        if divisor > 1:
            part /= divisor
        reduced.append(
            layouts.dtensor_from_local(
                part,
                mesh,
                layouts.reduced_placements(g.placements),
                shape=g.shape,
                stride=g.stride(),
            )
        )
    return reduced


def _average_divisor(value):
    """The number of parts a partial average of `value` was summed over."""
    divisor = 1
    for mesh_dim, placement in enumerate(value.placements):
        if placement.is_partial() and placement.reduce_op == "avg":
            divisor *= value.device_mesh.size(mesh_dim)
    return divisor


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


# The reduction of the train step running now, if it overlaps the backward
# pass (see `overlapped_reduction`).
_overlapped = {"reduction": None}


@contextlib.contextmanager
def overlapped_reduction(model):
    """All-reduces gradient buckets as the backward pass produces them.

    Entered around Keras' own train step (one backward pass, then
    `reduce_with_loss`), which takes the reduced buckets. Hooks on the
    trainable variables launch each bucket's all-reduce asynchronously once
    its gradients are accumulated; a bucket whose gradients cannot be
    reduced together (not all partial sums of one mesh axis and dtype) is
    left to `reduce_with_loss`. Only variables on a 1-D mesh (data
    parallelism) take part; does nothing with fewer than two buckets.

    Args:
        model: the model whose train step runs in the block.

    Yields:
        Nothing.
    """
    # Data parallelism only (a 1-D mesh): on a model-parallel mesh the
    # backward pass runs collectives of its own, which these would race.
    variables = [
        v
        for v in getattr(model, "trainable_weights", ())
        if isinstance(v.value, DTensor)
        and v.value.requires_grad
        and v.value.device_mesh.ndim == 1
    ]
    optimizer = getattr(model, "optimizer", None)
    buckets = _reverse_buckets(variables)
    if optimizer is None or len(buckets) < 2:
        yield
        return
    reduction = _OverlappedReduction(optimizer, buckets)
    handles = [
        v.value.register_post_accumulate_grad_hook(
            functools.partial(reduction.gradient_ready, b, i)
        )
        for b, bucket in enumerate(buckets[:-1])
        for i, v in enumerate(bucket)
    ]
    _overlapped["reduction"] = reduction
    try:
        yield
        # Launched but not taken (the step did not reduce its gradients):
        # waited for, so that every process leaves the step in step.
        reduction.wait_all()
    finally:
        _overlapped["reduction"] = None
        for handle in handles:
            handle.remove()


def _reverse_buckets(variables):
    """`variables` in reverse order, in buckets of DDP's sizes."""
    buckets, bucket, size = [], [], 0
    for v in reversed(variables):
        local = v.value.to_local()
        bucket.append(v)
        size += local.numel() * local.element_size()
        cap = BUCKET_BYTES if buckets else FIRST_BUCKET_BYTES
        if size >= cap:
            buckets.append(bucket)
            bucket, size = [], 0
    if bucket:
        buckets.append(bucket)
    return buckets


class _OverlappedReduction:
    """The buckets of one train step, launched as their gradients arrive."""

    def __init__(self, optimizer, buckets):
        self.buffers = _GRADIENT_BUFFERS.setdefault(optimizer, {})
        self.arrived = [[None] * len(bucket) for bucket in buckets]
        # (gradients, flat buffer, work) of each launched bucket.
        self.launched = []

    def gradient_ready(self, bucket_index, position, parameter):
        arrived = self.arrived[bucket_index]
        arrived[position] = parameter.grad
        if all(g is not None for g in arrived):
            with torch.no_grad():
                self._launch(bucket_index, arrived)

    def _launch(self, bucket_index, gradients):
        mesh_dim = _single_reduction_dim(gradients)
        if mesh_dim is None:
            return  # Left to `reduce_with_loss`.
        first = gradients[0]
        key = ("overlapped", bucket_index, first.dtype, first.device)
        flat = _flat_buffer(self.buffers, key, gradients)
        torch.cat([g.to_local().reshape(-1) for g in gradients], out=flat)
        work = dist.all_reduce(
            flat,
            op=_reduce_op(first.placements[mesh_dim]),
            group=first.device_mesh.get_group(mesh_dim),
            async_op=True,
        )
        self.launched.append((gradients, flat, work))

    def wait_all(self):
        """Waits for the launched buckets; maps each gradient to its sum."""
        timeout = datetime.timedelta(seconds=health.current_timeout())
        reduced = {}
        for gradients, flat, work in self.launched:
            work.wait(timeout)
            for g, r in zip(gradients, _unpack_bucket(gradients, flat)):
                reduced[id(g)] = (g, r)
        self.launched = []
        return reduced


def _single_reduction_dim(gradients):
    """The mesh axis a bucket is reduced over, or `None` if it cannot be.

    A bucket is reduced by one asynchronous all-reduce when its gradients
    share a mesh, placements and dtype, and are partial over exactly one
    mesh axis of more than one process.
    """
    first = gradients[0]
    if not isinstance(first, DTensor):
        return None
    for g in gradients:
        if not (
            isinstance(g, DTensor)
            and g.device_mesh is first.device_mesh
            and g.placements == first.placements
            and g.dtype == first.dtype
        ):
            return None
    mesh = first.device_mesh
    dims = [
        d
        for d, p in enumerate(first.placements)
        if p.is_partial() and mesh.size(d) > 1
    ]
    return dims[0] if len(dims) == 1 else None


def _finish_overlapped(gradients):
    """`gradients` with those reduced during the backward pass replaced."""
    reduction = _overlapped["reduction"]
    if reduction is None:
        return gradients
    reduced = reduction.wait_all()
    result = []
    for g in gradients:
        entry = reduced.get(id(g))
        result.append(entry[1] if entry and entry[0] is g else g)
    return result
