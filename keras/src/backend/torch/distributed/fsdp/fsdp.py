"""Weights sharded over the batch axis, gathered one layer call at a time, as
FSDP2's `fully_shard` (left to DTensor, every process would compute the whole
batch): freed on return, re-gathered at the first gradient reaching outputs."""

import contextlib

import torch

from keras.src import tree
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.fsdp import fsdp_call
from keras.src.backend.torch.distributed.fsdp import fsdp_schedule

GATHER_WEIGHTS_ENV = "KERAS_DISTRIBUTION_GATHER_WEIGHTS"
RESHARD_ENV = "KERAS_DISTRIBUTION_RESHARD_AFTER_FORWARD"


def gathered_mesh_dims(distribution):
    """The mesh dims a call gathers weights along (`GATHER_WEIGHTS_ENV`): a
    tuple (empty: none), or `None` for every dim a weight is sharded on."""
    meaning = "gathers a layer's weights over the batch axis for its call"
    choice = fsdp_schedule.env_choice(
        GATHER_WEIGHTS_ENV, "batch", ("batch", "all", "off"), meaning
    )
    if choice != "batch":
        return () if choice == "off" else None
    names = list(distribution.device_mesh.axis_names)
    batch_dim_name = getattr(distribution, "batch_dim_name", None)
    return (names.index(batch_dim_name),) if batch_dim_name in names else ()


def reshards_after_forward():
    """Whether a layer's gathered weights are freed when its call returns."""
    meaning = "frees them after the call, gathers them again for its backward"
    choice = fsdp_schedule.env_choice(RESHARD_ENV, "1", ("1", "0"), meaning)
    return choice == "1"


def _gathered_to(variable, value, distribution, mesh_dims):
    """`value`'s placements, `Replicate` where sharded over several processes
    on `mesh_dims` (and the model dim if `gathered_for_call`), or `None`."""
    if not isinstance(value, DTensor):
        return None
    for_call = getattr(distribution, "gathered_for_call", None)
    if mesh_dims is not None and for_call and for_call(variable):
        names = list(distribution.device_mesh.axis_names)
        mesh_dims = {*mesh_dims, names.index(distribution.model_dim_name)}
    placements = [
        Replicate()
        if (mesh_dims is None or dim in mesh_dims)
        and p.is_shard()
        and value.device_mesh.size(dim) > 1
        else p
        for dim, p in enumerate(value.placements)
    ]
    return None if placements == list(value.placements) else placements


def eager_reason(model, distribution):
    """Why a compiled step of `model` must run eagerly here (some trainable
    weight is gathered in its calls), or `None`."""
    mesh_dims = gathered_mesh_dims(distribution)
    if mesh_dims != () and any(
        _gathered_to(v, v.value, distribution, mesh_dims) is not None
        for v in model.trainable_variables
    ):
        return (
            "weights sharded over the batch axis (or gathered whole for "
            "each call by the distribution's plan) are gathered one layer "
            "at a time and freed after use, which torch.compile cannot trace "
            f"(set {GATHER_WEIGHTS_ENV}=off to compile DTensor's own plan "
            "instead)"
        )


@contextlib.contextmanager
def gathered_weights(layer, distribution, enabled=True):
    """Gathers the sharded weights of `layer`'s call; yields a function to
    call on the outputs: it frees them and arranges re-gathering."""
    call = _call_gather(layer, distribution) if enabled else None
    enclosing = list(fsdp_call.calls_now())
    if call is None:
        # These outputs' gradient may reach the enclosing call's weights
        # before its outputs' does (an activity regularizer's loss).
        watch = enclosing and enabled
        yield (lambda outputs: _watch(enclosing, outputs)) if watch else _same
        return
    schedule = fsdp_schedule.running_schedule()
    last = schedule is not None and schedule.take_ahead(layer, call)
    call.enter()
    fsdp_call.calls_now().append(call)
    if schedule is not None:
        schedule.gather_ahead(layer, lambda x: _call_gather(x, distribution))
    try:
        # Notes the gathered values autograd saves: those backward re-gathers.
        noting = torch.is_grad_enabled() and reshards_after_forward()
        hooks = torch.autograd.graph.saved_tensors_hooks
        with hooks(_note_saved, _same) if noting else contextlib.nullcontext():
            yield lambda outputs: _release_after_forward(
                call, enclosing, outputs, schedule, last
            )
    finally:
        fsdp_call.calls_now().pop()
        call.exit()


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
    if torch.is_grad_enabled() and reshards_after_forward():
        for x in _leaves(outputs):
            if x.requires_grad:
                for call in calls:
                    x.register_hook(call.on_gradient)
    return outputs


def _call_gather(layer, distribution):
    """The `CallGather` (or `None`) of `layer`'s sharded call variables, less
    those in use (inside its own call, a recurrent cell, or one gathering)."""
    mesh_dims = gathered_mesh_dims(distribution)
    if mesh_dims == ():
        return None
    calls = fsdp_call.calls_now()
    gathered_now = {id(w.variable) for call in calls for w in call.weights}
    weights = []
    for v in _call_variables(layer):
        targets = _gathered_to(v, v._value, distribution, mesh_dims)
        if id(v) not in gathered_now and targets and not v._value.is_meta:
            weights.append(fsdp_call.GatheredWeight(v, targets))
    return fsdp_call.CallGather(weights) if weights else None


def _call_variables(layer):
    """The trainable variables a call of `layer` gathers: its own, and unless
    a model, those of its sublayers (breadth first) with its dtype policy."""
    from keras.src.models.model import Model

    variables = list(getattr(layer, "_trainable_variables", None) or ())
    if isinstance(layer, Model):
        return variables
    policy = _policy(layer)
    pending = list(layer._flatten_layers(include_self=False, recursive=False))
    while pending:
        sublayer = pending.pop(0)
        if isinstance(sublayer, Model) or _policy(sublayer) != policy:
            continue
        variables.extend(getattr(sublayer, "_trainable_variables", None) or ())
        pending.extend(
            sublayer._flatten_layers(include_self=False, recursive=False)
        )
    return list({id(v): v for v in variables}.values())


def _policy(layer):
    names = ("compute_dtype", "variable_dtype", "autocast")
    return tuple(getattr(layer, name, None) for name in names)


def _release_after_forward(call, enclosing, outputs, schedule, last):
    """Frees `call`'s gathered storage, unless `last`, to re-gather later."""
    leaves = _leaves(outputs)
    watched = list(enclosing)
    if call.release(leaves, reshards_after_forward() and not last):
        call.restore_ahead_of = schedule and schedule.released(call)
        watched.insert(0, call)
    elif last and torch.is_grad_enabled():
        restore_ahead = schedule.released()
        if restore_ahead is not None:
            _on_first_gradient(leaves, restore_ahead)
    _watch(watched, leaves)
    return outputs


def _on_first_gradient(outputs, function):
    """Calls `function` once, at the first gradient reaching `outputs`."""
    pending = [function]

    def hook(grad):
        if pending:
            pending.pop()()
        return grad

    for x in outputs:
        if x.requires_grad:
            x.register_hook(hook)
