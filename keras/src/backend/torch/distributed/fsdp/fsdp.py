"""Weights sharded over the batch axis, gathered one layer at a time.

A `LayoutMap` that puts the batch axis on a weight dimension (keras-hub's
Llama map: query/key/value `("model", "batch", None)`) asks for what torch
calls FSDP and JAX users get from GSPMD: each process keeps a shard of the
weight, the batch stays sharded, and the weight is assembled only while it
is used. Left to DTensor, a kernel sharded on its input features is
contracted shard by shard with activations resharded to match, and every
layer output is then a partial sum reduced to a replicated value: each
process computes the whole batch, and every weight gradient is
materialized whole, replicated, until the optimizer runs (keras 8 x
Dense(4096) on 4 processes: 3.3x the ideal memory, see
`benchmarks/bench_fsdp.py`).

Here, as FSDP2's `fully_shard` does per module, a layer call gathers the
trainable weights of the layer and of its sublayers along the batch axis
first (`gathered_weights`; one collective for all of them, see
`fsdp_gather`; the call's weights are held by an `fsdp_call.CallGather`),
so that DTensor computes the layer data-parallel on the
sharded batch:

- forward: the gathered value replaces the variable's value during the
  call. Once the call returns, the gathered storage is freed (FSDP2's
  reshard-after-forward): what autograd saved of it (the weight, or views
  of it such as an einsum's permutations) keeps its metadata, not its
  memory. A saved-tensor hook notes, during the call, which gathered
  values autograd saves;
- backward: the first gradient that reaches one of the layer's outputs
  gathers the saved ones again, into the same storage, before the layer's
  backward ops read them; once a weight's gradient is complete, its
  storage is freed again. The gradients are reduce-scattered, partial sums
  of the batch, to the weights' own shards: a weight gradient is whole
  only for one layer at a time, and the optimizer gets it in the weight's
  layout.

The gathers are ordered by the layer calls and the backward pass, the same
on every process. Freeing storage that autograd saved is FSDP2's own
technique; the storage is that of the gathered copy, never the weight's.

Within a step, each layer's weights can be gathered while the layer
before it computes, as FSDP2 prefetches (see `fsdp_schedule`).

Under mixed precision (a layer computing in a narrower dtype than its
variables), a weight is cast on its shards and gathered in the compute
dtype, as FSDP2's `MixedPrecisionPolicy(param_dtype=...)` does: the
gathered copy autograd saves is then the one freed, the gather moves half
the bytes, and the gradient is reduce-scattered in the compute dtype.

`KERAS_DISTRIBUTION_GATHER_WEIGHTS` chooses the mesh axes: `"batch"` (the
default: the distribution's batch axis), `"all"` (every axis a weight is
sharded on: ZeRO-3 over the model axis too, instead of tensor parallelism)
or `"off"` (DTensor's own plan). A distribution may also name weights it
stores sharded over the model axis but has used whole
(`AutoModelParallel.gathered_for_call`: attention heads the axis does not
divide): those are gathered along it too, unless `"off"`.
`KERAS_DISTRIBUTION_RESHARD_AFTER_FORWARD=0` keeps each layer's gathered
weights from its call until its backward ops have run instead of freeing
and gathering them again (FSDP2's `reshard_after_forward=False`): fewer
gathers, more memory. Compiled steps (`jit_compile=True`) run eagerly when
weights are gathered (see `compiled_step.eager_reason`).
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
    """The mesh dimensions along which weights are gathered for a call.

    Args:
        distribution: the distribution in effect.

    Returns:
        A tuple of mesh dimension indices (empty: gather nothing), or
        `None` for every dimension a weight is sharded on.
    """
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
    """The placements of `value` gathered along `mesh_dims`.

    Args:
        value: a variable's value.
        mesh_dims: see `gathered_mesh_dims`.

    Returns:
        The placements with `Replicate` on each of `mesh_dims` where
        `value` is sharded over more than one process, or `None` if it is
        not such a `DTensor`.
    """
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
    """Whether a layer's gathered weights are freed when its call returns.

    Returns:
        `KERAS_DISTRIBUTION_RESHARD_AFTER_FORWARD` (`"1"`, the default, or
        `"0"`: kept until the layer's backward ops have run) as a `bool`.
    """
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
    """Whether some trainable weight of `model` is gathered in its calls.

    Args:
        model: a model.
        distribution: the distribution in effect.

    Returns:
        A `bool`.
    """
    mesh_dims = gathered_mesh_dims(distribution)
    if mesh_dims == ():
        return False
    return any(
        gathered_placements(v.value, _mesh_dims_of(v, distribution, mesh_dims))
        is not None
        for v in model.trainable_variables
    )


def _mesh_dims_of(variable, distribution, mesh_dims):
    """The mesh dimensions `variable` is gathered along for a call: those
    of every weight, and the model axis for a weight the distribution
    stores sharded but has used whole (`gathered_for_call`)."""
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
    """Gathers the sharded trainable weights of `layer`'s call.

    A layer that is not a model gathers its own weights and those of its
    sublayers of the same dtype policy, in one collective per mesh
    dimension and dtype (`fsdp_gather`), as FSDP2 gathers a module wrapped
    by `fully_shard`: a transformer block is gathered at once, not layer by
    layer. A model gathers only its own weights: its layers gather theirs
    when it calls them, so that its weights are whole one block at a time.
    A sublayer of another dtype policy gathers its own, in the dtype it
    reads them in.

    Args:
        layer: the layer being called.
        distribution: the distribution in effect.
        enabled: `False` gathers nothing (a call on symbolic inputs, which
            reads no weight's values).

    Yields:
        A function of the call's outputs, to be called with them once the
        call returns: it frees the gathered storage autograd keeps and
        arranges for it to be gathered again in the backward pass. The
        gathered values stand for the weights until the context exits.
    """
    weights = _weights_to_gather(layer, distribution) if enabled else []
    enclosing = list(fsdp_call.calls_now())
    if not weights:
        if enclosing and enabled:
            # A call inside one that gathered: the gradient of its outputs
            # may reach the enclosing call's weights before the enclosing
            # call's outputs do (an activity regularizer's loss, an
            # `add_loss` of a router's logits).
            yield lambda outputs: _watch(enclosing, outputs)
        else:
            yield _no_outputs_to_watch
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


def _no_outputs_to_watch(outputs):
    return outputs


def _noting_saved_values():
    """Which gathered values autograd saves tells which ones the backward
    pass needs gathered again, if the call frees them."""
    if not (torch.is_grad_enabled() and reshards_after_forward()):
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_note_saved, _unpack)


def _note_saved(tensor):
    """The pack hook of the tensors autograd saves during calls that
    gathered: marks the gathered weights whose storage they read.

    Decided from what autograd saves, not from whether the gathered values
    are still alive after the call: a value held by a reference cycle lives
    until Python's garbage collector runs, at a different time on each
    process, and the processes would gather different weights.

    Returns:
        `tensor`, detached: the tensor itself would hold its own `grad_fn`
        when autograd saves an op's output, a cycle that would keep the
        activations alive until the garbage collector runs.
    """
    with torch.no_grad():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel():
            pointer = local.untyped_storage().data_ptr()
            for call in fsdp_call.calls_now():
                call.note_saved(pointer)
        return tensor.detach()


def _unpack(tensor):
    return tensor


def _leaves(outputs):
    return [
        x
        for x in tree.flatten(outputs)
        if isinstance(x, torch.Tensor) and not x.is_meta
    ]


def _watch(calls, outputs):
    """Makes the first gradient reaching one of `outputs` gather the
    weights of `calls` again, if they were freed.

    Returns:
        `outputs`.
    """
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
            # The layer is called inside its own call (a recurrent cell),
            # or inside the call that gathered its weights.
            continue
        placements = gathered_placements(
            value, _mesh_dims_of(variable, distribution, mesh_dims)
        )
        if placements is not None and not value.is_meta:
            weights.append(fsdp_call.GatheredWeight(variable, placements))
    return weights


def _call_variables(layer):
    """The trainable variables a call of `layer` gathers: its own, and
    those of its sublayers (not models) of the same dtype policy."""
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
    return (
        getattr(layer, "compute_dtype", None),
        getattr(layer, "variable_dtype", None),
        getattr(layer, "autocast", None),
    )


def _release_after_forward(call, enclosing, outputs, schedule, last):
    """Frees the gathered storage of `call`'s weights once the call
    returned `outputs` (unless it is the step's `last` call to gather),
    and watches the outputs' gradients to gather it again."""
    leaves = _leaves(outputs)
    if call.release(leaves, reshards_after_forward() and not last):
        restore_ahead = None
        if schedule is not None:
            restore_ahead = schedule.released(call)
        call.restore_ahead_of = restore_ahead
        _watch([call], leaves)
    elif last and torch.is_grad_enabled():
        restore_ahead = schedule.kept()
        if restore_ahead is not None:
            _on_first_gradient(leaves, restore_ahead)
    if enclosing:
        _watch(enclosing, leaves)
    return outputs


def _on_first_gradient(outputs, function):
    """Calls `function` once, when the first gradient reaches one of
    `outputs`."""
    called = []

    def hook(grad):
        if not called:
            called.append(True)
            function()
        return grad

    for x in outputs:
        if x.requires_grad:
            x.register_hook(hook)
