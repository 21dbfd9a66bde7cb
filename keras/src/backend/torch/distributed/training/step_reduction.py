"""Keras' own train step's gradient reduction, overlapped with backward as DDP's
reducer does: reverse-order buckets (the first small) are all-reduced
asynchronously as backward completes them; the last, with the loss tracker's
partial sum (`defer`), in `reduce_step_gradients`. Per-sample models take
weights as plain leaves (`local_leaf`), avoiding DTensor's per-weight dispatch.
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
    """A train step's `gradients`, reduced once in buckets after `reduction`;
    those reducing to replicated values come back as local tensors, which the
    optimizer computes on (its flat buffers are reused)."""
    as_local = gradients_lib.reduces_to_replicated(gradients)
    deferred = []
    if reduction is not None:
        gradients = reduction.finish(gradients, as_local)
        deferred, reduction.deferred = reduction.deferred, []
    # The deferred state first: in the first bucket whatever its size.
    reduced = gradients_lib.reduce_gradients(
        [value for _, _, value in deferred] + list(gradients),
        gradients_lib.optimizer_buffers(optimizer),
        as_local,
    )
    with torch.no_grad():
        for (_, local, _), value in zip(deferred, reduced):
            local.copy_(local_state.local_value(value).reshape(local.shape))
    return reduced[len(deferred) :]


@contextlib.contextmanager
def overlapped_reduction(model, leaves, plans):
    """Yields the `OverlappedReduction` of a train step (or `None`), which
    all-reduces the gradient buckets of 1-D mesh variables as backward
    completes them. `leaves` and `plans`: dicts kept across steps."""
    trainable = list(getattr(model, "trainable_weights", ()))
    key = tuple(id(v) for v in trainable)
    plan = plans.get(key)
    if plan is None:
        plan = _BucketPlan(trainable)
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
        # Launched but not taken: wait, so processes leave the step together.
        reduction.wait_all(as_local=False)
        if reduction.deferred:  # The step's gradients were not reduced.
            reduction._reduce_pending([], [])
    finally:
        for leaf in reduction.leaf_of.values():
            leaf.grad = None  # Freed before the next step.
        for handle in reduction.handles:
            handle.remove()


def _reverse_buckets(variables):
    """`variables` reversed, in buckets of DDP's sizes, the first small.

    Sized by global shapes, as every process buckets alike (a weight sharded
    unevenly has local parts of different sizes).
    """
    return gradients_lib.buckets(
        variables[::-1],
        lambda v: v.value.numel() * v.value.element_size(),
        gradients_lib.FIRST_BUCKET_BYTES,
    )


class _BucketPlan:
    """The buckets of a model's trainable weights on a 1-D mesh, per step (a
    model-parallel mesh's backward runs collectives these would race)."""

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
    """The buckets of one train step, launched as their gradients arrive: as
    `DTensor`s or, for a leaf (`local_leaf`), plain partial sums over the
    variable's 1-D mesh."""

    def __init__(self, optimizer, plan, leaves):
        self.buffers = gradients_lib.optimizer_buffers(optimizer)
        self.trainable = plan.trainable
        self.buckets = plan.buckets
        self.positions = plan.positions
        self.arrived = [[None] * len(bucket) for bucket in self.buckets]
        # By id(variable): all leaves made (kept across steps), this step's.
        self.leaves = leaves
        self.leaf_of = {}
        # (bucket index, gradients, flat buffer, work) of each launch.
        self.launched = []
        self.handles = []
        # (mesh, local tensor, partial value), see `defer`.
        self.deferred = []

    def local_leaf(self, variable):
        """The plain leaf sharing replicated `variable`'s local storage in this
        step; `None` for a variable this reduction does not reduce."""
        if id(variable) not in self.positions:
            return None
        leaf = self.leaf_of.get(id(variable))
        if leaf is not None:
            return leaf
        with torch.no_grad():
            local = variable.value.to_local()
        leaf = self.leaves.get(id(variable))
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
        """Defers partial sum `value` for replicated `local` to the last bucket
        (the loss tracker's: nothing reads it before the optimizer); whether
        taken: `value` must be a sum partial over the data mesh."""
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
        # A shared weight accumulates again after its bucket completed: wait
        # for and forget the earlier launch, whose buffer this one reuses.
        for entry in [e for e in self.launched if e[0] == bucket_index]:
            entry[3].wait(datetime.timedelta(seconds=health.current_timeout()))
            self.launched.remove(entry)
        first = gradients[0]
        flat, work = gradients_lib.all_reduced(
            [local_state.local_value(g) for g in gradients],
            [reduction],
            self.buffers,
            ("overlapped", bucket_index, first.dtype, first.device),
            async_op=True,
        )
        self.launched.append((bucket_index, gradients, flat, work))

    def _reduction_of(self, bucket_index, gradients):
        """`(process group, op)` of a bucket, `None` if it has none: plain
        gradients of one dtype, or `DTensor`s laid out alike and partial over
        one mesh axis."""
        if not any(isinstance(g, DTensor) for g in gradients):
            mesh = self.buckets[bucket_index][0].value.device_mesh
            if len({g.dtype for g in gradients}) > 1 or mesh.size() == 1:
                return None
            return mesh.get_group(0), dist.ReduceOp.SUM
        first = gradients[0]
        if not all(
            isinstance(g, DTensor)
            and g.device_mesh == first.device_mesh
            and g.placements == first.placements
            and g.dtype == first.dtype
            for g in gradients
        ):
            return None
        dims = gradients_lib.partial_dims(first.device_mesh, first.placements)
        if len(dims) != 1:
            return None
        return (
            first.device_mesh.get_group(dims[0]),
            gradients_lib.reduce_op(first.placements[dims[0]]),
        )

    def wait_all(self, as_local):
        """Waits for the launches: `{id(variable): (gradient, reduced)}`."""
        timeout = datetime.timedelta(seconds=health.current_timeout())
        reduced = {}
        for bucket_index, gradients, flat, work in self.launched:
            work.wait(timeout)
            if isinstance(gradients[0], DTensor):
                values = gradients_lib.unpack_bucket(gradients, flat, as_local)
            else:
                values = gradients_lib.views(flat, gradients)
            bucket = self.buckets[bucket_index]
            for v, gradient, value in zip(bucket, gradients, values):
                reduced[id(v)] = (gradient, value)
        self.launched = []
        return reduced

    def finish(self, gradients, as_local):
        """The step's `gradients` (a leaf's `None`) with what this reduced:
        waits for the launched buckets, then reduces the unlaunched leaves
        (`as_local` as in `gradients.reduce_gradients`)."""
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
                # Also used through DTensor (a regularization loss): add the
                # leaf's partial gradient.
                result[i] = gradients[i]
                if leaf.grad is not None:
                    mesh = gradients[i].device_mesh
                    result[i] = gradients[i] + DTensor.from_local(
                        leaf.grad,
                        mesh,
                        [Partial()] * mesh.ndim,
                        run_check=False,
                    )
                continue
            gradient = gradients[i] if leaf is None else leaf.grad
            entry = launched.get(id(variable))
            # Reduced as launched, unless accumulated again since.
            if entry is not None and entry[0] is gradient:
                result[i] = entry[1]
            elif leaf is not None and gradient is not None:
                pending.append((i, variable, gradient))
        if pending:
            self._reduce_pending(pending, result)
        return result

    def _reduce_pending(self, pending, result):
        """All-reduces `pending` leaf gradients and the deferred state."""
        deferred, self.deferred = self.deferred, []
        parts = [
            (value.to_local(), mesh, tuple(value.placements))
            for mesh, _, value in deferred
        ]
        parts += [
            (gradient, variable.value.device_mesh, (Partial(),))
            for _, variable, gradient in pending
        ]
        reduced = gradients_lib.reduce_parts(parts, self.buffers, ("leaves",))
        for (_, local, _), value in zip(deferred, reduced):
            with torch.no_grad():
                local.copy_(value.reshape(local.shape))
        for (i, _, _), value in zip(pending, reduced[len(deferred) :]):
            result[i] = value
