"""Layers coupling a batch's samples in a model run on the local rows: each
is called alone through DTensor on the global batch, weights replicated, and
its outputs return to the rows."""

import contextlib
import dataclasses
import threading

import torch

from keras.src import tree
from keras.src.backend.common import global_state
from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.common.masking import set_keras_mask
from keras.src.backend.common.stateless_scope import get_stateless_scope
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import random_draws
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Partial
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard

# The running call's `Routing`, per thread as layer calls are.
_state = threading.local()


class NotRows(Exception):
    """A coupled layer's output is not split by the rows of the batch."""


def innermost_layer():
    """The innermost layer being called (a name scope's caller), or `None`."""
    from keras.src.layers import Layer

    stack = global_state.get_global_attribute("name_scope_stack") or ()
    for scope in reversed(stack):
        if isinstance(scope.caller, Layer):
            return scope.caller
    return None


def loss_adding_layers(model):
    """The layers of `model` that added a loss in its last call."""
    return [
        layer
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if layer._get_own_losses()
    ]


@dataclasses.dataclass(frozen=True)
class Batch:
    """Where this process' rows sit in a local call's global batch."""

    mesh: object
    global_rows: int
    local_rows: int
    placements: tuple
    start: int


def batch_of(values):
    """The `Batch` of `values`: all DTensors sharded on axis 0 over a 1-D
    mesh (or replicated on one process), a row or more each, or `None`."""
    leaves = [x for x in tree.flatten(values) if hasattr(x, "shape")]
    if not leaves or not all(isinstance(x, DTensor) for x in leaves):
        return None
    mesh = leaves[0].device_mesh
    global_rows = leaves[0].shape[0] if leaves[0].ndim else 0
    placements = tuple(leaves[0].placements)
    single = mesh.size() == 1 and placements == (Replicate(),)
    if mesh.ndim != 1 or not (placements == (Shard(0),) or single):
        return None
    for x in leaves:
        if (
            x.ndim == 0
            or x.device_mesh != mesh
            or tuple(x.placements) != placements
            or x.shape[0] != global_rows
        ):
            return None
    parts = [
        layouts.chunk_bounds(global_rows, mesh.size(), i)
        for i in range(mesh.size())
    ]
    if any(stop <= start for start, stop in parts):
        return None
    start, stop = parts[mesh.get_local_rank()]
    return Batch(mesh, global_rows, stop - start, placements, start)


def replicated_on(value, mesh):
    """Whether `value` is a DTensor replicated on `mesh`."""
    return (
        isinstance(value, DTensor)
        and value.device_mesh == mesh
        and all(p.is_replicate() for p in value.placements)
    )


@dataclasses.dataclass
class Routing:
    """A local-rows call's coupled layers' ids, their activity regularizers
    by id, and the losses they added."""

    layer_ids: frozenset
    batch: Batch
    regularizers: dict
    losses: list = dataclasses.field(default_factory=list)

    def added_only(self, losses):
        """Whether every loss in `losses` was added by a coupled layer."""
        ids = {id(x) for x in self.losses}
        return all(id(x) in ids for x in losses)


@contextlib.contextmanager
def routed(layers, batch):
    """Yields a `Routing`; in the block, `layers` run through DTensor."""
    previous = getattr(_state, "routing", None)
    # `_regularize` regularizes the global outputs, not `Layer.__call__`.
    regularizers = {
        id(layer): layer.activity_regularizer
        for layer in layers
        if getattr(layer, "activity_regularizer", None) is not None
    }
    routing = Routing(frozenset(id(x) for x in layers), batch, regularizers)
    _state.routing = routing
    for layer in layers:
        if id(layer) in regularizers:
            layer.activity_regularizer = None
    try:
        yield routing
    finally:
        _state.routing = previous
        for layer in layers:
            if id(layer) in regularizers:
                layer.activity_regularizer = regularizers[id(layer)]


def routing(layer):
    """The local call's `Batch` if `layer` is routed through DTensor."""
    current = getattr(_state, "routing", None)
    if current is None or id(layer) not in current.layer_ids:
        return None
    return current.batch


def call(through_dtensor, plain_as_replicated, layer, batch, args, kwargs):
    """Calls coupled `layer` through DTensor on local-row inputs; returns
    the outputs' local rows, or raises `NotRows`. `plain_as_replicated`: a
    context mixing plain tensors with DTensors, for the regularizer."""
    scope = get_stateless_scope()
    losses_before = len(scope.losses)
    local_values = [
        (v, scope.get_current_value(v))
        for v in layer.variables
        if scope.get_current_value(v) is not None
    ]
    for variable, value in local_values:
        scope.add_update((variable, _replicated(value, batch.mesh)))
    entered = {id(v): scope.get_current_value(v) for v, _ in local_values}
    args, kwargs = tree.map_structure(
        lambda x: _batch_dtensor(x, batch), (args, kwargs)
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
    return tree.map_structure(lambda x: _local_rows(x, batch), outputs)


def _regularize(layer, outputs):
    """Adds `layer`'s activity loss on its global `outputs`, as `Layer` does."""
    regularizer = _state.routing.regularizers.get(id(layer))
    if regularizer is None:
        return
    for output in tree.flatten(outputs):
        if isinstance(output, torch.Tensor):
            loss = regularizer(output)
            if output.ndim > 0:
                loss = loss / output.shape[0] if output.shape[0] else loss * 0
            layer.add_loss(loss)


def keep_losses(model, losses):
    """Keeps coupled layers' `losses` where Keras would: the enclosing
    stateless scope if any, else the layers'."""
    if not losses:
        return
    outer = get_stateless_scope()
    if outer is not None:
        if outer.collect_losses:
            for loss in losses:
                outer.add_loss(loss)
        return
    ids = {id(x): x for x in losses}
    for sublayer in model._flatten_layers(include_self=True, recursive=True):
        sublayer._losses.extend(
            ids[key] for key in list(sublayer._loss_ids) if key in ids
        )


class _ReplicatedWeight(torch.autograd.Function):
    """A local weight as a replicated `DTensor`, its gradient a partial sum:
    a replicated gradient is kept on the first process only, counted once."""

    @staticmethod
    def forward(ctx, local, mesh):
        ctx.mesh = mesh
        placements = [Replicate()] * mesh.ndim
        return DTensor.from_local(local, mesh, placements, run_check=False)

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, DTensor):
            return _first_process_only(grad, ctx.mesh), None
        if all(
            p.is_partial() and p.reduce_op == "sum" for p in grad.placements
        ):
            return grad.to_local(), None
        whole = grad.redistribute(ctx.mesh, [Replicate()] * ctx.mesh.ndim)
        return _first_process_only(whole.to_local(), ctx.mesh), None


def whole(value):
    """A global value as a plain tensor: a `DTensor`'s full value."""
    if not isinstance(value, DTensor):
        return value
    placements = [Replicate()] * value.device_mesh.ndim
    return value.redistribute(value.device_mesh, placements).to_local()


def _first_process_only(grad, mesh):
    return grad if mesh.get_local_rank() == 0 else torch.zeros_like(grad)


def _replicated(value, mesh):
    if isinstance(value, DTensor):
        return value
    if value.requires_grad and torch.is_grad_enabled():
        return _ReplicatedWeight.apply(value, mesh)
    return DTensor.from_local(
        value, mesh, [Replicate()] * mesh.ndim, run_check=False
    )


def _batch_dtensor(x, batch):
    """A local input of the coupled layer as the global batch's DTensor."""
    if (
        isinstance(x, torch.Tensor)
        and not isinstance(x, DTensor)
        and x.ndim > 0
        and x.shape[0] == batch.local_rows
    ):
        output = _sharded(x, batch)
        mask = get_keras_mask(x)
        if mask is not None:
            set_keras_mask(output, _sharded(mask, batch))
        return output
    return x


def _sharded(x, batch):
    shape = (batch.global_rows,) + tuple(x.shape[1:])
    return layouts.dtensor_from_local(
        x.contiguous(), batch.mesh, list(batch.placements), shape=shape
    )


def _local_rows(x, batch):
    """This process' rows of a coupled layer's output, as a plain tensor."""
    if not isinstance(x, DTensor):
        return x
    rows = _rows_of(x, batch)
    mask = get_keras_mask(x)
    if mask is not None:
        set_keras_mask(rows, _rows_of(mask, batch))
    return rows


def _rows_of(x, batch):
    """This process' rows of `x`, axis 0 holding `k >= 1` items per row."""
    if x.device_mesh != batch.mesh or x.ndim == 0:
        raise NotRows(f"an output of shape {tuple(x.shape)}")
    per_row, rest = divmod(x.shape[0], batch.global_rows)
    if rest or not per_row:
        raise NotRows(f"an output of shape {tuple(x.shape)}")
    start = batch.start * per_row
    stop = start + batch.local_rows * per_row
    if tuple(x.placements) == tuple(batch.placements):
        local = x.to_local()
        if local.shape[0] != stop - start:
            raise NotRows(f"an output of shape {tuple(x.shape)}")
        return local
    # Each takes its rows of the whole; their gradients, zero elsewhere, are
    # partial sums of the whole gradient.
    whole = x.redistribute(batch.mesh, [Replicate()] * batch.mesh.ndim)
    local = whole.to_local(grad_placements=[Partial()] * batch.mesh.ndim)
    return local[start:stop]
