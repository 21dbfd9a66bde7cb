"""Weights sharded over the batch axis, gathered one layer at a time (FSDP).

Left to DTensor, a kernel sharded on its input features makes every process
compute the whole batch. As FSDP2's `fully_shard`, a layer call gathers its
weights (in the compute dtype) in one collective, frees them on return and
re-gathers them at the first gradient reaching its outputs.
"""

import contextlib
import os

import torch

from keras.src import tree
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.fsdp import fsdp_call
from keras.src.backend.torch.distributed.fsdp import fsdp_schedule

GATHER_WEIGHTS_ENV = "KERAS_DISTRIBUTION_GATHER_WEIGHTS"
_GATHER_CHOICES = ("batch", "all", "off")
RESHARD_ENV = "KERAS_DISTRIBUTION_RESHARD_AFTER_FORWARD"


def gathered_mesh_dims(distribution):
    """The mesh dims a call gathers weights along (`GATHER_WEIGHTS_ENV`): a
    tuple (empty: none), or `None` for every dim a weight is sharded on."""
    choice = os.environ.get(GATHER_WEIGHTS_ENV, "batch").lower()
    if choice not in _GATHER_CHOICES:
        raise ValueError(
            f"{GATHER_WEIGHTS_ENV} must be one of {_GATHER_CHOICES}. "
            f"Received: {GATHER_WEIGHTS_ENV}={choice!r}"
        )
    if choice == "off":
        return ()
    if choice == "all":
        return None
    batch_dim_name = getattr(distribution, "batch_dim_name", None)
    axis_names = list(distribution.device_mesh.axis_names)
    if batch_dim_name not in axis_names:
        return ()
    return (axis_names.index(batch_dim_name),)


def gathered_placements(value, mesh_dims):
    """`value`'s placements with `Replicate` on each of `mesh_dims` where it
    is sharded over several processes; `None` if there is none."""
    if not isinstance(value, DTensor):
        return None
    mesh = value.device_mesh
    placements = list(value.placements)
    gathered = False
    for dim, placement in enumerate(placements):
        chosen = mesh_dims is None or dim in mesh_dims
        if chosen and placement.is_shard() and mesh.size(dim) > 1:
            placements[dim] = Replicate()
            gathered = True
    return placements if gathered else None


def reshards_after_forward():
    """Whether a layer's gathered weights are freed when its call returns."""
    choice = os.environ.get(RESHARD_ENV, "1")
    if choice not in ("0", "1"):
        raise ValueError(
            f"{RESHARD_ENV} must be '1' (free a layer's gathered weights "
            "after its call, gather them again for its backward) or '0' "
            f"(keep them until its backward). Received: {RESHARD_ENV}="
            f"{choice!r}"
        )
    return choice == "1"


def has_gathered_weights(model, distribution):
    """Whether some trainable weight of `model` is gathered in its calls."""
    mesh_dims = gathered_mesh_dims(distribution)
    if mesh_dims == ():
        return False
    return any(
        gathered_placements(v.value, _mesh_dims_of(v, distribution, mesh_dims))
        is not None
        for v in model.trainable_variables
    )


def _mesh_dims_of(variable, distribution, mesh_dims):
    """`mesh_dims`, plus the model axis for a `gathered_for_call` weight."""
    gathered_for_call = getattr(distribution, "gathered_for_call", None)
    if mesh_dims is None or not (
        gathered_for_call and gathered_for_call(variable)
    ):
        return mesh_dims
    axis_names = list(distribution.device_mesh.axis_names)
    model_dim = axis_names.index(distribution.model_dim_name)
    return tuple(sorted(set(mesh_dims) | {model_dim}))


@contextlib.contextmanager
def gathered_weights(layer, distribution, enabled=True):
    """Gathers the sharded trainable weights of `layer`'s call (with its
    same-policy sublayers' unless a model); yields a function to call on
    the outputs, freeing the gathered storage and arranging re-gathering."""
    weights = _weights_to_gather(layer, distribution) if enabled else []
    enclosing = list(fsdp_call.calls_now())
    if not weights:
        if enclosing and enabled:
            # These outputs' gradient may reach the enclosing call's weights
            # before its outputs' does (an activity regularizer's loss).
            yield lambda outputs: _watch(enclosing, outputs)
        else:
            yield _same
        return
    call = fsdp_call.CallGather(weights)
    schedule = fsdp_schedule.running_schedule()
    last = False
    if schedule is not None:
        position = schedule.take_ahead(layer, call)
        last = schedule.is_last(position, layer)
    call.enter()
    fsdp_call.calls_now().append(call)
    if schedule is not None:
        schedule.gather_ahead(
            layer,
            lambda following: fsdp_call.CallGather.of(
                _weights_to_gather(following, distribution)
            ),
        )
    try:
        with _noting_saved_values():
            yield lambda outputs: _release_after_forward(
                call, enclosing, outputs, schedule, last
            )
    finally:
        fsdp_call.calls_now().pop()
        call.exit()


def _noting_saved_values():
    """Notes the gathered values autograd saves: those backward re-gathers."""
    if not (torch.is_grad_enabled() and reshards_after_forward()):
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_note_saved, _same)


def _note_saved(tensor):
    """Pack hook marking the gathered weights `tensor` reads (not those that
    outlive the call: processes collect cycles unevenly). Detached, lest a
    saved output's own `grad_fn` keep activations alive."""
    with torch.no_grad():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel():
            pointer = local.untyped_storage().data_ptr()
            for call in fsdp_call.calls_now():
                call.note_saved(pointer)
        return tensor.detach()


def _same(value):
    return value


def _leaves(outputs):
    return [
        x
        for x in tree.flatten(outputs)
        if isinstance(x, torch.Tensor) and not x.is_meta
    ]


def _watch(calls, outputs):
    """Re-gathers `calls`' weights at the first gradient reaching `outputs`."""
    if not (torch.is_grad_enabled() and reshards_after_forward()):
        return outputs
    for x in _leaves(outputs):
        if x.requires_grad:
            for call in calls:
                x.register_hook(call.on_gradient)
    return outputs


def _weights_to_gather(layer, distribution):
    mesh_dims = gathered_mesh_dims(distribution)
    if mesh_dims == ():
        return []
    gathered_now = fsdp_call.gathered_variables()
    weights = []
    for variable in _call_variables(layer):
        value = variable._value
        if id(variable) in gathered_now:
            # Inside its own call (a recurrent cell) or one that gathered it.
            continue
        placements = gathered_placements(
            value, _mesh_dims_of(variable, distribution, mesh_dims)
        )
        if placements is not None and not value.is_meta:
            weights.append(fsdp_call.GatheredWeight(variable, placements))
    return weights


def _call_variables(layer):
    """The trainable variables a call of `layer` gathers."""
    from keras.src.models.model import Model

    variables = list(getattr(layer, "_trainable_variables", None) or ())
    if isinstance(layer, Model):
        return variables
    policy = _policy(layer)
    seen = {id(v) for v in variables}
    pending = list(layer._flatten_layers(include_self=False, recursive=False))
    while pending:
        sublayer = pending.pop(0)
        if isinstance(sublayer, Model) or _policy(sublayer) != policy:
            continue
        for variable in getattr(sublayer, "_trainable_variables", None) or ():
            if id(variable) not in seen:
                seen.add(id(variable))
                variables.append(variable)
        pending.extend(
            sublayer._flatten_layers(include_self=False, recursive=False)
        )
    return variables


def _policy(layer):
    names = ("compute_dtype", "variable_dtype", "autocast")
    return tuple(getattr(layer, name, None) for name in names)


def _release_after_forward(call, enclosing, outputs, schedule, last):
    """Frees `call`'s gathered storage, unless `last`, to re-gather later."""
    leaves = _leaves(outputs)
    if call.release(leaves, reshards_after_forward() and not last):
        call.restore_ahead_of = (
            None if schedule is None else schedule.released(call)
        )
        _watch([call], leaves)
    elif last and torch.is_grad_enabled():
        restore_ahead = schedule.kept()
        if restore_ahead is not None:
            _on_first_gradient(leaves, restore_ahead)
    if enclosing:
        _watch(enclosing, leaves)
    return outputs


def _on_first_gradient(outputs, function):
    """Calls `function` once, at the first gradient reaching `outputs`."""
    called = []

    def hook(grad):
        if not called:
            called.append(True)
            function()
        return grad

    for x in outputs:
        if x.requires_grad:
            x.register_hook(hook)
