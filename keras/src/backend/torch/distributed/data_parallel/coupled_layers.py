"""Layers coupling samples in a model run on local rows: each called alone via
DTensor on the global batch (weights replicated), its outputs back on rows."""

import collections
import contextlib
import threading

import torch

from keras.src import tree
from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.common.masking import set_keras_mask
from keras.src.backend.common.stateless_scope import get_stateless_scope
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import random_draws
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core import structures
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Partial
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard

_state = threading.local()  # The running call's `Routing`, per thread.


class NotRows(Exception):
    """A coupled layer's output is not split by the rows of the batch."""


Batch = collections.namedtuple(  # Where local rows sit in the global batch.
    "Batch", ["mesh", "global_rows", "local_rows", "placements", "start"]
)


def batch_of(values):
    """The `Batch` of `values`: all DTensors sharded on axis 0 over a 1-D
    mesh (or replicated on one process), a row or more each, or `None`."""
    leaves = [x for x in structures.flatten(values) if hasattr(x, "shape")]
    if not leaves or not all(isinstance(x, DTensor) for x in leaves):
        return None
    mesh, placements = leaves[0].device_mesh, tuple(leaves[0].placements)
    global_rows = leaves[0].shape[0] if leaves[0].ndim else 0
    n = mesh.size()
    single = n == 1 and placements == (Replicate(),)
    if mesh.ndim != 1 or not (placements == (Shard(0),) or single):
        return None
    # `torch.chunk`'s last part is its smallest: if it has rows, all have.
    last = layouts.chunk_bounds(global_rows, n, n - 1)
    if last[1] <= last[0] or any(
        x.shape[:1] != (global_rows,)
        or x.device_mesh != mesh
        or tuple(x.placements) != placements
        for x in leaves
    ):
        return None
    start, stop = layouts.chunk_bounds(global_rows, n, mesh.get_coordinate()[0])
    return Batch(mesh, global_rows, stop - start, placements, start)


def batch_group():
    """The batch's process group of this thread's local-rows call, or `None`."""
    current = getattr(_state, "routing", None)
    return None if current is None else current.batch.mesh.get_group()


# A local call's coupled layers' ids, `Batch`, regularizers by id, losses.
Routing = collections.namedtuple(
    "Routing", ["layer_ids", "batch", "regularizers", "losses"]
)


@contextlib.contextmanager
def routed(layers, batch):
    """Yields a `Routing`; in the block, `layers` run through DTensor."""
    previous = getattr(_state, "routing", None)
    # `_regularize` regularizes the global outputs, not `Layer.__call__`.
    regularized = [x for x in layers if getattr(x, "activity_regularizer", 0)]
    regularizers = {id(x): x.activity_regularizer for x in regularized}
    ids = frozenset(id(x) for x in layers)
    _state.routing = routing = Routing(ids, batch, regularizers, [])
    for layer in regularized:
        layer.activity_regularizer = None
    try:
        yield routing
    finally:
        _state.routing = previous
        for layer in regularized:
            layer.activity_regularizer = regularizers[id(layer)]


def suspended_call(call_fn, layer, args, kwargs, through, plain_as_replicated):
    """A layer call in a local-rows call: via `call` if routed, else as is."""
    current = getattr(_state, "routing", None)
    if not current or id(layer) not in current.layer_ids:
        return call_fn(layer, *args, **kwargs)
    batch = current.batch
    return call(through, plain_as_replicated, layer, batch, args, kwargs)


def call(through_dtensor, plain_as_replicated, layer, batch, args, kwargs):
    """Calls coupled `layer` through DTensor on local-row inputs: its outputs'
    rows, or raises `NotRows` (`plain_as_replicated`: for the regularizer)."""
    scope = get_stateless_scope()
    losses_before = len(scope.losses)
    local_values = [(v, scope.get_current_value(v)) for v in layer.variables]
    local_values = [(v, x) for v, x in local_values if x is not None]
    entered = {id(v): _replicated(x, batch.mesh) for v, x in local_values}
    for variable, _ in local_values:
        scope.add_update((variable, entered[id(variable)]))
    args, kwargs = tree.map_structure(
        lambda x: with_mask(sharded, x, batch) if is_rows(x, batch) else x,
        (args, kwargs),
    )
    try:
        with runtime.distribution_resumed(), random_draws.outside_rows():
            outputs = through_dtensor(args, kwargs)
            with plain_as_replicated():
                _regularize(layer, outputs)
    finally:
        for variable, value in local_values:
            new_value = scope.get_current_value(variable)
            if new_value is not entered[id(variable)]:
                # A global value assigned (moving statistics), maybe partial.
                value = whole(new_value)
            scope.add_update((variable, value))
        _state.routing.losses.extend(scope.losses[losses_before:])
    return tree.map_structure(
        lambda x: with_mask(_rows, x, batch) if isinstance(x, DTensor) else x,
        outputs,
    )


def _regularize(layer, outputs):
    """Adds `layer`'s activity loss on its global `outputs`, as `Layer` does."""
    regularizer = _state.routing.regularizers.get(id(layer))
    for output in [] if regularizer is None else tree.flatten(outputs):
        if isinstance(output, torch.Tensor):
            loss = regularizer(output)
            if output.ndim > 0:
                loss = loss / output.shape[0] if output.shape[0] else loss * 0
            layer.add_loss(loss)


def keep_losses(model, losses):
    """Keeps coupled layers' `losses` where Keras would (scope or layers)."""
    outer = get_stateless_scope()
    if outer is not None and outer.collect_losses:
        for loss in losses:
            outer.add_loss(loss)
    elif outer is None and losses:
        ids = {id(x): x for x in losses}
        for layer in model._flatten_layers(include_self=True, recursive=True):
            layer._losses.extend(
                ids[key] for key in list(layer._loss_ids) if key in ids
            )


class _ReplicatedWeight(torch.autograd.Function):
    """A local weight as a replicated `DTensor` (1-D mesh), its gradient a
    partial sum: a replicated one is kept on the first process (once)."""

    @staticmethod
    def forward(ctx, local, mesh):
        ctx.mesh = mesh
        return DTensor.from_local(local, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor):
            if all(
                p.is_partial() and p.reduce_op == "sum" for p in grad.placements
            ):
                return grad.to_local(), None
            grad = grad.full_tensor()
        if ctx.mesh.get_local_rank() != 0:
            grad = torch.zeros_like(grad)
        return grad, None


def whole(value):
    """A global value as a plain tensor: a `DTensor`'s full value."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def _replicated(value, mesh):
    """A local weight as a `DTensor` replicated on the 1-D `mesh`."""
    if isinstance(value, DTensor):
        return value
    if value.requires_grad and torch.is_grad_enabled():
        return _ReplicatedWeight.apply(value, mesh)
    return DTensor.from_local(value, mesh, [Replicate()], run_check=False)


def is_rows(x, batch):
    """Whether `x` is a plain tensor of this process' rows of `batch`."""
    return (
        isinstance(x, torch.Tensor)
        and not isinstance(x, DTensor)
        and x.shape[:1] == (batch.local_rows,)
    )


def with_mask(convert, x, batch):
    """`convert(x, batch)`, with `x`'s Keras mask converted alike."""
    output = convert(x, batch)
    mask = get_keras_mask(x)
    if mask is not None:
        set_keras_mask(output, convert(mask, batch))
    return output


def sharded(x, batch):
    """This process' rows `x` as the global batch's DTensor."""
    shape = (batch.global_rows,) + tuple(x.shape[1:])
    return layouts.dtensor_from_local(
        x.contiguous(), batch.mesh, list(batch.placements), shape=shape
    )


def _rows(x, batch):
    """This process' rows of `x`, axis 0 holding `k >= 1` items per row."""
    per_row, rest = divmod(x.shape[0] if x.ndim else 0, batch.global_rows)
    start = batch.start * per_row
    stop = start + batch.local_rows * per_row
    if x.device_mesh == batch.mesh and per_row and not rest:
        if tuple(x.placements) != tuple(batch.placements):
            # Each takes its rows of the whole; their gradients, zero
            # elsewhere, are partial sums of the whole gradient.
            return x.full_tensor(grad_placements=(Partial(),))[start:stop]
        local = x.to_local()
        if local.shape[0] == stop - start:
            return local
    raise NotRows(f"an output of shape {tuple(x.shape)}")
