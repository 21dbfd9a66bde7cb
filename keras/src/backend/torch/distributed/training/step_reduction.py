"""The gradient reduction of Keras' own train step, overlapped with backward.

In Keras' eager train step (one backward pass, then `reduce_step_gradients`)
under data parallelism, gradient buckets are all-reduced while the backward
pass runs, as DDP's reducer does: the variables are grouped in reverse
order, the order in which the backward pass produces their gradients, the
first bucket small; a bucket's all-reduce is launched asynchronously as
soon as its last gradient is accumulated. The last bucket is complete only
when the backward pass ends: it is reduced then, after the others are
waited for, together with the loss the loss tracker took as a partial sum
before the backward pass (`defer`), so a step issues one collective per
bucket.

A per-sample model runs on each process' rows (see `local_rows`). In this
step its trainable weights enter as plain leaf tensors that share their
storage with the weights' local tensors (`local_leaf`), kept from one step
to the next. Autograd accumulates each process' partial gradient on them
as plain tensors, and the reduced gradients reach the optimizer as local
tensors, which `gradients.apply_gradients` updates on anyway. Taken
through DTensor (a `Partial` gradient built for each weight, torch's
`local_map`) they cost DTensor's dispatch per weight and step, a large part
of a small model's step.

The train step (`step.DistributedStep`) owns its reduction and the leaves;
the gradient hooks hold the reduction itself, as autograd may run them on
threads of its own (CUDA devices'), where no thread-local lookup would
find it.
"""

import contextlib
import datetime
import functools

import torch
import torch.distributed as dist

from keras.src.backend.torch.distributed.core import local_state
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Partial
from keras.src.backend.torch.distributed.health import health
from keras.src.backend.torch.distributed.training import (
    gradients as gradients_lib,
)


def reduce_step_gradients(reduction, optimizer, gradients):
    """Reduces a train step's gradients once, in buckets.

    Values replicated once reduced come back as local tensors (the whole
    values): the optimizer computes on those. With nothing to reduce, the
    gradients come back as they are.

    Args:
        reduction: the step's `OverlappedReduction`, or `None` if its
            buckets were not reduced during the backward pass.
        optimizer: the optimizer the gradients are for (its flat buffers
            are reused).
        gradients: list of gradients (`DTensor`, tensor or `None`), in the
            order of the model's trainable weights.

    Returns:
        The gradients, reduced.
    """
    as_local = gradients_lib.reduces_to_replicated(gradients)
    deferred = []
    if reduction is not None:
        gradients = reduction.finish(gradients, as_local)
        deferred = reduction.take_deferred()
    # The deferred state first: in the first bucket whatever its size.
    reduced = gradients_lib.reduce_gradients(
        [value for _, value in deferred] + list(gradients),
        gradients_lib.optimizer_buffers(optimizer),
        as_local,
    )
    with torch.no_grad():
        for (local, _), value in zip(deferred, reduced):
            local.copy_(local_state.local_value(value).reshape(local.shape))
    return reduced[len(deferred) :]


@contextlib.contextmanager
def overlapped_reduction(model, leaves, plans=None):
    """All-reduces gradient buckets as the backward pass produces them.

    Entered around Keras' own eager train step, which takes the reduced
    buckets in `reduce_step_gradients`. Hooks launch each bucket's all-reduce
    asynchronously once its gradients are accumulated; a bucket whose
    gradients cannot be reduced together (not all partial sums of one mesh
    axis and dtype) is left to `reduce_step_gradients`. Only variables on a 1-D
    mesh (data parallelism) take part. The hooks hold the reduction itself
    (autograd may run them on threads of its own: CUDA devices').

    Args:
        model: the model whose train step runs in the block.
        leaves: a dict kept from one step to the next, in which the plain
            leaves standing for the weights are kept (see `local_leaf`).
        plans: optionally, a dict kept from one step to the next, in which
            the buckets are kept for the model's trainable weights (see
            `_BucketPlan`): computed once, not in every step.

    Yields:
        The `OverlappedReduction`, or `None` if there is nothing to reduce.
    """
    trainable = list(getattr(model, "trainable_weights", ()))
    # The same weights (made trainable or not since: other weights) have
    # the same buckets.
    key = tuple(id(v) for v in trainable)
    plan = None if plans is None else plans.get(key)
    if plan is None:
        plan = _BucketPlan(trainable)
        if plans is not None:
            plans.clear()  # Only the current weights' plan is kept.
            plans[key] = plan
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not plan.buckets:
        yield None
        return
    reduction = OverlappedReduction(optimizer, plan, leaves)
    for bucket in reduction.buckets[:-1]:
        for v in bucket:
            reduction.handles.append(
                v.value.register_post_accumulate_grad_hook(
                    functools.partial(reduction.gradient_ready, id(v))
                )
            )
    try:
        yield reduction
        # Launched but not taken (the step did not reduce its gradients):
        # waited for, so that every process leaves the step in step.
        reduction.wait_all(as_local=False)
        reduction.complete_deferred()
    finally:
        reduction.drop_leaf_gradients()
        for handle in reduction.handles:
            handle.remove()


def _reverse_buckets(variables):
    """`variables` in reverse order (the backward pass'), in buckets of
    DDP's sizes, the first small."""
    return gradients_lib.buckets(
        variables[::-1],
        lambda v: gradients_lib.nbytes(v.value),
        gradients_lib.FIRST_BUCKET_BYTES,
    )


class _BucketPlan:
    """The buckets of a model's trainable weights, for every step.

    Args:
        trainable: the model's trainable weights, in the order of the
            train step's gradients.

    Attributes:
        trainable: the weights, as given.
        buckets: the lists of weights reduced together, in the order the
            backward pass produces them (see `_reverse_buckets`): the
            weights of a 1-D mesh only (data parallelism; on a
            model-parallel mesh the backward pass runs collectives of its
            own, which these would race).
        positions: `id(weight)` -> `(bucket index, index in the bucket)`.
    """

    def __init__(self, trainable):
        self.trainable = trainable
        variables = [
            v
            for v in trainable
            if isinstance(v.value, DTensor)
            and v.value.requires_grad
            and v.value.device_mesh.ndim == 1
        ]
        self.buckets = _reverse_buckets(variables)
        self.positions = {
            id(v): (b, i)
            for b, bucket in enumerate(self.buckets)
            for i, v in enumerate(bucket)
        }


class OverlappedReduction:
    """The buckets of one train step, launched as their gradients arrive.

    A variable's gradient arrives either as its `DTensor` gradient or, for
    a weight that entered the step as a leaf (`local_leaf`), as the leaf's
    plain gradient: a partial sum over the variable's (1-D) mesh. The
    leaves are kept from one step to the next, by the step that owns the
    reduction.

    Args:
        optimizer: the optimizer (its flat buffers are reused).
        plan: the `_BucketPlan` of the model's trainable weights.
        leaves: the plain leaves made so far, by `id(variable)`.
    """

    def __init__(self, optimizer, plan, leaves):
        self.buffers = gradients_lib.optimizer_buffers(optimizer)
        # The variables in the order of the train step's gradients.
        self.trainable = plan.trainable
        self.buckets = plan.buckets
        self.positions = plan.positions
        self.arrived = [[None] * len(bucket) for bucket in self.buckets]
        # Every leaf made so far, by id(variable): kept from step to step.
        self.leaves = leaves
        # The leaves this step computed with, by id(variable).
        self.leaf_of = {}
        # (bucket index, gradients, flat buffer, work) of each launch.
        self.launched = []
        # The gradient hooks this step registered.
        self.handles = []
        # `(mesh, local tensor, partial value)` of replicated state to
        # write whole with the last bucket (see `defer`).
        self.deferred = []

    def local_leaf(self, variable):
        """The plain leaf standing for a replicated weight in this step.

        Args:
            variable: a trainable variable, replicated on a 1-D mesh.

        Returns:
            A tensor sharing the storage of the variable's local tensor,
            whose gradient autograd accumulates as a plain tensor; `None`
            for a variable this reduction does not reduce (the caller then
            takes the local value through DTensor).
        """
        if id(variable) not in self.positions:
            return None
        leaf = self.leaf_of.get(id(variable))
        if leaf is not None:
            return leaf
        with torch.no_grad():
            local = variable.value.to_local()
        leaf = self.leaves.get(id(variable))
        # A new value (a new storage) is a new leaf.
        if leaf is None or leaf.data_ptr() != local.data_ptr():
            leaf = local.detach().requires_grad_()
            self.leaves[id(variable)] = leaf
        self.leaf_of[id(variable)] = leaf
        self.handles.append(
            leaf.register_post_accumulate_grad_hook(
                functools.partial(self.gradient_ready, id(variable))
            )
        )
        return leaf

    def defer(self, local, value):
        """Takes a partial sum assigned to replicated state, to be written
        whole once reduced with the last bucket.

        The loss tracker meets the step's loss as a partial sum before the
        backward pass; nothing reads its state before the optimizer, so
        its total is reduced with the gradients instead of by a collective
        of its own.

        Args:
            local: the state's local tensor.
            value: its new value.

        Returns:
            Whether `value` was taken: a sum partial over the data mesh.
        """
        mesh = self.trainable[0].value.device_mesh
        placements = getattr(value, "placements", None)
        if not (
            isinstance(value, DTensor)
            and value.device_mesh == mesh
            and len(placements) == 1
            and placements[0].is_partial()
            and placements[0].reduce_op == "sum"
        ):
            return False
        self.deferred.append((mesh, local, value.detach()))
        return True

    def gradient_ready(self, variable_id, tensor):
        bucket_index, position = self.positions[variable_id]
        if bucket_index == len(self.buckets) - 1:
            return  # Complete only when the backward pass ends.
        arrived = self.arrived[bucket_index]
        arrived[position] = tensor.grad
        if all(g is not None for g in arrived):
            with torch.no_grad():
                self._launch(bucket_index, arrived)

    def _launch(self, bucket_index, gradients):
        reduction = self._reduction_of(bucket_index, gradients)
        if reduction is None:
            return  # Left to `reduce_step_gradients`.
        group, op = reduction
        self._supersede(bucket_index)
        first = gradients[0]
        key = ("overlapped", bucket_index, first.dtype, first.device)
        flat = gradients_lib.flat_buffer(self.buffers, key, gradients)
        torch.cat(
            [local_state.local_value(g).reshape(-1) for g in gradients],
            out=flat,
        )
        work = dist.all_reduce(flat, op=op, group=group, async_op=True)
        self.launched.append((bucket_index, gradients, flat, work))

    def _supersede(self, bucket_index):
        """Waits for and forgets an earlier launch of a bucket launched
        again: a weight used twice (a shared layer) accumulates a second
        gradient after its bucket was complete, and the new launch reuses
        the buffer the earlier one may still be reducing."""
        earlier = [e for e in self.launched if e[0] == bucket_index]
        if not earlier:
            return
        timeout = datetime.timedelta(seconds=health.current_timeout())
        for entry in earlier:
            entry[3].wait(timeout)
            self.launched.remove(entry)

    def _reduction_of(self, bucket_index, gradients):
        """`(process group, op)` of a bucket, `None` if it has none."""
        if not any(isinstance(g, DTensor) for g in gradients):
            mesh = self.buckets[bucket_index][0].value.device_mesh
            if len({g.dtype for g in gradients}) > 1 or mesh.size() == 1:
                return None
            return mesh.get_group(0), dist.ReduceOp.SUM
        mesh_dim = _single_reduction_dim(gradients)
        if mesh_dim is None:
            return None
        first = gradients[0]
        return (
            first.device_mesh.get_group(mesh_dim),
            gradients_lib.reduce_op(first.placements[mesh_dim]),
        )

    def wait_all(self, as_local):
        """Waits for the launched buckets.

        Returns:
            A dict from each reduced variable's id to a tuple `(gradient,
            reduced gradient)` (see `gradients.reduce_gradients` for
            `as_local`; a leaf's is always local).
        """
        timeout = datetime.timedelta(seconds=health.current_timeout())
        reduced = {}
        for bucket_index, gradients, flat, work in self.launched:
            work.wait(timeout)
            if isinstance(gradients[0], DTensor):
                values = gradients_lib.unpack_bucket(gradients, flat, as_local)
            else:
                values = _views(flat, gradients)
            bucket = self.buckets[bucket_index]
            for v, gradient, value in zip(bucket, gradients, values):
                reduced[id(v)] = (gradient, value)
        self.launched = []
        return reduced

    def finish(self, gradients, as_local):
        """The step's gradients, with what this reduction reduced.

        Waits for the launched buckets, then all-reduces the gradients of
        the leaves not launched yet.

        Args:
            gradients: the train step's gradients, in the order of the
                model's trainable weights (a leaf's is `None` there).
            as_local: see `gradients.reduce_gradients`.

        Returns:
            The gradients.
        """
        if len(gradients) != len(self.trainable):
            raise RuntimeError(
                "The train step's gradients do not match the model's "
                f"trainable weights: {len(gradients)} gradients for "
                f"{len(self.trainable)} weights."
            )
        launched = self.wait_all(as_local)
        result, pending = list(gradients), []
        for i, variable in enumerate(self.trainable):
            leaf = self.leaf_of.get(id(variable))
            if leaf is not None and gradients[i] is not None:
                # Also used through DTensor (a regularization loss): the
                # two gradients add up, reduced as a `DTensor`.
                result[i] = _with_leaf_gradient(gradients[i], leaf.grad)
                continue
            gradient = gradients[i] if leaf is None else leaf.grad
            entry = launched.get(id(variable))
            # Reduced as launched unless accumulated again since.
            if entry is not None and entry[0] is gradient:
                result[i] = entry[1]
            elif leaf is not None and gradient is not None:
                pending.append((i, variable, gradient))
        if pending:
            self._reduce_pending(pending, result)
        return result

    def take_deferred(self):
        """The deferred state (see `defer`) no bucket reduced, as pairs
        `(local tensor, partial value)`, now the caller's to reduce."""
        deferred, self.deferred = self.deferred, []
        return [(local, value) for _, local, value in deferred]

    def _reduce_pending(self, pending, result):
        """All-reduces `pending` leaf gradients into `result`, and the
        deferred state (see `defer`) into its local tensors."""
        deferred, self.deferred = self.deferred, []
        if not pending and not deferred:
            return
        # Grouped by mesh and dtype, the deferred state first in each.
        groups = {}
        for mesh, local, value in deferred:
            key = (mesh, value.dtype)
            groups.setdefault(key, []).append((local, value.to_local()))
        for i, variable, gradient in pending:
            key = (variable.value.device_mesh, gradient.dtype)
            groups.setdefault(key, []).append((i, gradient))
        for (mesh, dtype), entries in groups.items():
            values = [value for _, value in entries]
            if mesh.size() > 1:
                key = ("leaves", mesh, dtype, values[0].device)
                flat = gradients_lib.flat_buffer(self.buffers, key, values)
                torch.cat([x.reshape(-1) for x in values], out=flat)
                dist.all_reduce(flat, group=mesh.get_group(0))
                values = _views(flat, values)
            for (target, _), value in zip(entries, values):
                if isinstance(target, int):
                    result[target] = value
                else:
                    with torch.no_grad():
                        target.copy_(value.reshape(target.shape))

    def complete_deferred(self):
        """Writes the deferred state whole (see `defer`) if the step's
        gradients were not reduced."""
        if self.deferred:
            self._reduce_pending([], [])

    def drop_leaf_gradients(self):
        """Frees the leaves' gradients: the next step starts without."""
        for leaf in self.leaf_of.values():
            leaf.grad = None


def _views(flat, values):
    """Views of `flat` shaped as each of `values` (their local parts)."""
    views, offset = [], 0
    for x in values:
        local = local_state.local_value(x)
        views.append(flat[offset : offset + local.numel()].view(local.shape))
        offset += local.numel()
    return views


def _with_leaf_gradient(gradient, leaf_gradient):
    """A weight's `DTensor` gradient plus its leaf's partial gradient."""
    if leaf_gradient is None:
        return gradient
    mesh = gradient.device_mesh
    partial = DTensor.from_local(
        leaf_gradient, mesh, [Partial()] * mesh.ndim, run_check=False
    )
    return gradient + partial


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
