"""Keras' train step's gradient buckets all-reduced as backward completes them
(DDP); the last, with the loss tracker's sum, by `reduce_step_gradients`."""

import contextlib
import datetime
import functools

import torch

from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import local_state
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Partial
from keras.src.backend.torch.distributed.health import health
from keras.src.backend.torch.distributed.training import (
    gradients as gradients_lib,
)


def reduce_step_gradients(reduction, optimizer, gradients):
    """A train step's `gradients` reduced once, after `reduction` (or `None`);
    replicated ones as local tensors, which the optimizer computes on. What
    backward did not launch is issued before waiting for what it did."""
    as_local = all(
        all(p.is_partial() or p.is_replicate() for p in g.placements)
        for g in gradients
        if isinstance(g, DTensor)
    )
    deferred, taken = [], set()
    if reduction is not None:
        gradients, taken = reduction.finish(gradients)
        deferred, reduction.deferred = reduction.deferred, []
    sums = [  # The deferred state first: in the first bucket whatever its size.
        layouts.dtensor_from_local(x, m, [Partial()]) for m, _, x in deferred
    ]
    rest = [None if i in taken else g for i, g in enumerate(gradients)]
    reduced = gradients_lib.reduce_gradients(
        sums + rest, gradients_lib.optimizer_buffers(optimizer), as_local
    )
    _store(deferred, reduced)
    reduced = reduced[len(deferred) :]
    if reduction is not None:
        reduction.take_launched(reduced, taken, as_local)
    return reduced


def _store(deferred, values):
    """Copies `deferred` states' reduced `values` into their tensors."""
    with torch.no_grad():
        for (_, local, _), value in zip(deferred, values):
            local.copy_(local_state.local_value(value).reshape(local.shape))


@contextlib.contextmanager
def overlapped_reduction(model, leaves, plans, local=False):
    """Yields the `OverlappedReduction` of a train step, or `None`. `leaves`
    (`KeptLeaves`) and `plans` (a dict): kept across steps; `local`: whether
    the model may run on local rows, its weights as their kept leaves."""
    trainable = model.trainable_weights
    key = tuple(map(id, trainable))
    plan = plans.get(key)
    if plan is None:
        # 1-D meshes only: a model-parallel backward's collectives would race.
        buckets = _reverse_buckets(
            [
                v
                for v in trainable
                if isinstance(v.value, DTensor)
                and v.value.requires_grad
                and v.value.device_mesh.ndim == 1
            ]
        )
        positions = {
            id(v): (b, i)
            for b, bucket in enumerate(buckets)
            for i, v in enumerate(bucket)
        }
        plans.clear()  # Only the current weights' plan is kept.
        plan = plans[key] = (trainable, buckets, positions)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not plan[1]:
        yield None
        return
    reduction = leaves.reduction = OverlappedReduction(
        optimizer, plan, leaves, local
    )
    try:
        yield reduction
        # Launched but not taken: wait, so processes leave the step together.
        reduction.wait_all(as_local=False)
        reduction.flush()  # The step's gradients were not reduced.
    finally:
        leaves.reduction = None
        for leaf in reduction.leaf_of.values():
            leaf.grad = None  # Freed before the next step.
        for handle in reduction.handles:
            handle.remove()


@contextlib.contextmanager
def deferred_sums(mesh):
    """Yields a test step's `DeferredSums` over the 1-D `mesh`, reduced at the
    latest as the step ends."""
    sums = DeferredSums(mesh)
    yield sums
    sums.flush()


class DeferredSums:
    """A test step's partial sums of replicated state (the loss tracker's, the
    compiled metrics'), all-reduced together once, before the step reads
    them (`flush`): no collective of each metric's own."""

    def __init__(self, mesh):
        self.mesh, self.deferred = mesh, []

    def local_leaf(self, variable, value):
        return None  # A test step takes no gradients.

    def defer(self, local, value, mesh):
        """Whether `value`, this process' term of a sum over `mesh` for the
        replicated `local`, is summed at `flush`."""
        if mesh != self.mesh:
            return False
        self.deferred.append((mesh, local, value.detach()))
        return True

    def flush(self):
        """All-reduces the deferred terms, in one collective, into their
        states."""
        deferred, self.deferred = self.deferred, []
        if deferred:
            parts = [(value, mesh, (Partial(),)) for mesh, _, value in deferred]
            _store(deferred, gradients_lib.reduce_parts(parts))


class KeptLeaves(dict):
    """`{id(weight): (its replicated value, plain leaf, launches)}` kept across
    steps, a leaf whose bucket `launches` hooked once to report to the
    running `reduction`."""

    reduction = None

    def leaf(self, key, value, launches):
        """The leaf sharing `value`'s local storage, made anew for another
        value or where its bucket now launches or no longer does."""
        kept = self.get(key)
        if kept is None or kept[0] is not value or kept[2] != launches:
            with torch.no_grad():
                leaf = value.to_local().detach().requires_grad_()
            kept = self[key] = (value, leaf, launches)
            if launches:
                hook = functools.partial(self._ready, key)
                leaf.register_post_accumulate_grad_hook(hook)
        return kept[1]

    def _ready(self, key, leaf):
        if self.reduction and self.reduction.leaf_of.get(key) is leaf:
            self.reduction.gradient_ready(key, leaf)


def _launches(value):
    """Whether a weight's gradient is launched as it arrives: not on a mesh of
    one process, where a bucket has no axis to reduce over."""
    return value.device_mesh.size() > 1


def _reverse_buckets(variables):
    """`variables` reversed in DDP's buckets, by global sizes (so all agree),
    the first capped by `first_bucket_bytes`."""
    if not variables:
        return []
    mesh = variables[0].value.device_mesh
    first = gradients_lib.first_bucket_bytes(mesh)
    return gradients_lib.buckets(variables[::-1], lambda v: v.value, first)


class OverlappedReduction:
    """A train step's buckets, launched as gradients arrive: `DTensor`s or, for
    plain leaves (`local_leaf`: no DTensor dispatch), plain partial sums."""

    def __init__(self, optimizer, plan, leaves, local=False):
        self.buffers = gradients_lib.optimizer_buffers(optimizer)
        self.trainable, self.buckets, self.positions = plan
        self.arrived = [[None] * len(bucket) for bucket in self.buckets]
        # All leaves made (`KeptLeaves`); this step's, by id(variable).
        self.leaves, self.leaf_of = leaves, {}
        # `{bucket index: (gradients, flat, work)}`; `(mesh, local, value)`s.
        self.launched, self.deferred = {}, []
        self.handles = [
            v.value.register_post_accumulate_grad_hook(
                functools.partial(self.gradient_ready, id(v))
            )
            for bucket in self.buckets[:-1]
            for v in bucket
            if not (local and id(v) in leaves) and _launches(v.value)
        ]

    def local_leaf(self, variable, value):
        """The plain leaf sharing replicated `variable`'s local storage (its
        `value`), or `None` for a variable this reduction does not reduce."""
        key = id(variable)
        if key not in self.positions or key in self.leaf_of:
            return self.leaf_of.get(key)
        # The last bucket is reduced after backward: no arrival to report.
        launches = self.positions[key][0] < len(self.buckets) - 1
        launches = launches and _launches(value)
        leaf = self.leaf_of[key] = self.leaves.leaf(key, value, launches)
        return leaf

    def defer(self, local, value, mesh):
        """Whether `value`, this process' term of a sum over 1-D `mesh` for
        replicated `local`, is summed in the last bucket (the data mesh's)."""
        if mesh != self.trainable[0].value.device_mesh:
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
        """All-reduces a complete bucket asynchronously if its gradients are
        alike: of one dtype, plain partial sums over the 1-D mesh or `DTensor`s
        partial over one mesh axis (else `reduce_step_gradients` does)."""
        first = gradients[0]
        if isinstance(first, DTensor):
            mesh, placements = first.device_mesh, first.placements
        else:
            mesh = self.buckets[bucket_index][0].value.device_mesh
            placements = (Partial(),)
        dims = gradients_lib.partial_dims(mesh, placements)
        alike = {
            (g.dtype, g.device_mesh, g.placements)
            if isinstance(g, DTensor)
            else g.dtype
            for g in gradients
        }
        if len(dims) != 1 or len(alike) > 1:
            return
        op = gradients_lib.reduce_op(placements[dims[0]])
        # A shared weight accumulated again: wait, its buffer is reused.
        if bucket_index in self.launched:
            timeout = datetime.timedelta(seconds=health.current_timeout())
            self.launched.pop(bucket_index)[2].wait(timeout)
        self.launched[bucket_index] = (gradients,) + gradients_lib.all_reduced(
            [local_state.local_value(g) for g in gradients],
            [(mesh.get_group(dims[0]), op)],
            self.buffers,
            ("overlapped", bucket_index, first.dtype, first.device),
            async_op=True,
        )

    def wait_all(self, as_local):
        """Waits for the launches: `{id(variable): (gradient, reduced)}`."""
        reduced = {}
        if not self.launched:
            return reduced
        timeout = datetime.timedelta(seconds=health.current_timeout())
        for bucket_index, (gradients, flat, work) in self.launched.items():
            work.wait(timeout)
            values, g0 = gradients_lib.views(flat, gradients), gradients[0]
            if isinstance(g0, DTensor):  # All laid out alike (`_launch`).
                gradients_lib.averaged(flat, g0.device_mesh, g0.placements)
                values = [
                    gradients_lib.reduced_value(g, x, as_local)
                    for g, x in zip(gradients, values)
                ]
            for v, *entry in zip(self.buckets[bucket_index], gradients, values):
                reduced[id(v)] = entry
        self.launched = {}
        return reduced

    def finish(self, gradients):
        """`(gradients, taken)`: the step's `gradients` (a leaf's `None`), the
        leaves not launched reduced (while the launches may be in flight), and
        the indices of those the launches reduce (see `take_launched`)."""
        if len(gradients) != len(self.trainable):
            raise RuntimeError(
                "The train step's gradients do not match the model's "
                f"trainable weights: {len(gradients)} gradients for "
                f"{len(self.trainable)} weights."
            )
        in_flight = {
            id(v): g
            for index, (launched, _, _) in self.launched.items()
            for v, g in zip(self.buckets[index], launched)
        }
        result, pending, taken = list(gradients), [], set()
        for i, (v, gradient) in enumerate(zip(self.trainable, gradients)):
            leaf = self.leaf_of.get(id(v))
            if leaf is not None and gradient is not None:
                # Also used through DTensor (a regularizer): plus the leaf's.
                if leaf.grad is not None:
                    mesh = gradient.device_mesh
                    result[i] = gradient + layouts.dtensor_from_local(
                        leaf.grad, mesh, [Partial()] * mesh.ndim
                    )
                continue
            gradient = gradient if leaf is None else leaf.grad
            # Reduced as launched, unless accumulated again since.
            if gradient is not None and in_flight.get(id(v)) is gradient:
                taken.add(i)
            elif leaf is not None and gradient is not None:
                mesh = self.leaves[id(v)][0].device_mesh
                pending.append((i, (gradient, mesh, (Partial(),))))
        if pending:
            self._reduce_pending(pending, result)
        return result, taken

    def take_launched(self, result, taken, as_local):
        """Waits for the launches; their values into `result` at `taken`."""
        launched = self.wait_all(as_local)
        for i in taken:
            result[i] = launched[id(self.trainable[i])][1]

    def flush(self):
        """All-reduces the deferred state not reduced with the gradients."""
        if self.deferred:
            self._reduce_pending([], [])

    def _reduce_pending(self, pending, result):
        """All-reduces the deferred state and `pending` `(index, part)`s."""
        deferred, self.deferred = self.deferred, []
        parts = [(value, mesh, (Partial(),)) for mesh, _, value in deferred]
        parts += [part for _, part in pending]
        reduced = gradients_lib.reduce_parts(parts, self.buffers, ("leaves",))
        _store(deferred, reduced)
        for (i, _), value in zip(pending, reduced[len(deferred) :]):
            result[i] = value
