"""Data-parallel model calls on each process' own rows, as plain tensors.

With replicated weights and a sharded batch, a per-sample call (probed by
`batch_coupling`) computes on the local rows what DTensor would, without its
per-op dispatch; any coupling but `batch_statistics`', `random_draws`' and
`coupled_layers`' sends the step through DTensor from then on."""

import contextlib
import dataclasses
import functools
import threading
import weakref

import torch

from keras.src import tree
from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.common.masking import set_keras_mask
from keras.src.backend.torch.distributed.core import generator_states
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import local_state
from keras.src.backend.torch.distributed.core import random_draws
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Partial
from keras.src.backend.torch.distributed.data_parallel import batch_coupling
from keras.src.backend.torch.distributed.data_parallel import coupled_layers
from keras.src.backend.torch.distributed.dtensor_gaps import fallback

_STEPS_ATTRIBUTE = "_distributed_steps"
# This thread's `(process group, global rows)`, for `batch_moments`, reached
# via the backend's `moments` with no model at hand.
_local_call = threading.local()
_MIXES = "its outputs on the local rows differ"
# `{layer: {training: Verdict}}` for calls outside a step.
_verdicts = weakref.WeakKeyDictionary()


class ModelSteps:
    """A model's `step.DistributedStep`s by kind, and the one `running`."""

    def __init__(self):
        self.by_kind = {}
        self.running = None


def model_steps(model):
    """The `ModelSteps` of `model` (created on first use)."""
    steps = getattr(model, _STEPS_ATTRIBUTE, None)
    if steps is None:
        steps = ModelSteps()
        setattr(model, _STEPS_ATTRIBUTE, steps)
    return steps


def running_step(model):
    """The `step.DistributedStep` now running a step of `model`, or `None`."""
    steps = getattr(model, _STEPS_ATTRIBUTE, None)
    return None if steps is None else steps.running


def call(call_function, layer, args, kwargs, through_dtensor):
    """Calls outermost `layer` on the local rows if that gives DTensor's
    numbers: batch-sharded outputs, or `None` to call it through DTensor
    (`through_dtensor(args, kwargs)`, also the probe's call)."""
    step = running_step(layer)
    batch = coupled_layers.batch_of((args, kwargs))
    if batch is None or (step is not None and step.runs_through_dtensor):
        return None
    if step is not None:
        variables = step.local_variables(batch.mesh)
    else:
        variables = local_variables(layer, batch.mesh)
    if variables is None:
        return None
    verdicts = (
        _verdicts.setdefault(layer, {}) if step is None else step.verdicts
    )
    training = bool(kwargs.get("training"))
    verdict = verdicts.get(training)
    if verdict is None:
        if not classification_final(layer):
            return None
        outputs, verdict = _probe(
            call_function, layer, args, kwargs, through_dtensor, variables
        )
        if verdict is None:
            return outputs
        verdicts[training] = verdict
        if step is not None and not verdict.per_sample:
            step.runs_through_dtensor = True
        runtime.log_debug("%s: %s", layer.name, verdict)
        return outputs
    if not verdict.per_sample:
        return None
    return _call_locally(
        call_function, layer, (args, kwargs), batch, variables, verdict, step
    )


def verdict(layer, training=False):
    """The probe's `Verdict` on `layer`'s calls outside a step, or `None`."""
    return _verdicts.get(layer, {}).get(bool(training))


def _probe(call_function, layer, args, kwargs, through_dtensor, variables):
    """Calls `layer` through DTensor, then on the local rows replaying its
    draws: `(DTensor outputs, Verdict)`, the verdict `None` if the call
    built a layer."""
    batch = coupled_layers.batch_of((args, kwargs))
    before = [(v, v.value.to_local().clone()) for v in variables]
    rng_states = generator_states.take()
    watch = batch_coupling.PartialWatch()
    # The fallback's modes first: in a step they stay on past the watch.
    with batch_coupling.recording() as dtensor_calls:
        with fallback.dtensor_fallback(), watch:
            outputs = through_dtensor(args, kwargs)
    if len(layer.variables) != len(variables):
        return outputs, None
    rows = [_own_rows(x, batch) for x in tree.flatten(outputs) if x is not None]
    split = all(x is not None for x in rows)
    coupled = batch_coupling.coupling_layers(layer, watch)
    if not split or coupled is None:
        verdict = batch_coupling.verdict_of(
            watch, rows if split else None, None, None, coupled
        )
        return outputs, batch_coupling.agreed(verdict, batch.mesh)[0]
    after = generator_states.take()
    own_rows = functools.partial(_own_rows, batch=batch)
    layers, why = list(coupled[0]), coupled[1]
    while True:
        generator_states.restore(rng_states)
        with batch_coupling.recording() as local_calls:
            local_leaves, reason, plan = _checking_call(
                call_function, layer, (args, kwargs), before, batch, layers
            )
        if reason is None:
            # Else the processes' global generators diverge.
            if generator_states.differ(after, generator_states.take()):
                reason = "draws from a global generator otherwise on its rows"
            plan.python_draws = generator_states.python_advanced(
                rng_states, after
            )
        verdict = batch_coupling.verdict_of(
            watch, rows, local_leaves, reason, (tuple(layers), why)
        )
        differing = -1
        if verdict.reason == batch_coupling.DIFFERS:
            differing = batch_coupling.first_differing_layer(
                layer, dtensor_calls, local_calls, own_rows, layers
            )
        verdict, position = batch_coupling.agreed(
            verdict, batch.mesh, differing
        )
        if position < 0:
            break
        layers.append(list(layer._flatten_layers(include_self=False))[position])
        why = ", ".join(x for x in (why, _MIXES) if x)
    generator_states.restore(after)
    if verdict.per_sample:
        verdict = dataclasses.replace(verdict, draws=plan)
    return outputs, verdict


def _own_rows(x, batch):
    """This process' rows of a probe's output (cut if whole), or `None`."""
    if not (
        isinstance(x, DTensor)
        and x.device_mesh == batch.mesh
        and x.ndim > 0
        and x.shape[0] == batch.global_rows
    ):
        return None
    if tuple(x.placements) == batch.placements:
        return x.to_local()
    if all(p.is_replicate() for p in x.placements):
        start = batch.start
        return x.to_local()[start : start + batch.local_rows]
    return None


def _checking_call(call_function, layer, inputs, mapping, batch, coupled):
    """The probe's call on the local rows from `mapping`'s values, keeping
    nothing: `(output leaves, None, DrawPlan)` or `(None, reason, None)`."""
    # The `coupled` layers' losses from the DTensor call.
    losses = [x for c in coupled for x in c._get_own_losses()]
    local_args, local_kwargs = tree.map_structure(_to_local, inputs)
    plan = random_draws.DrawPlan()
    try:
        with torch.no_grad(), runtime.distribution_suspended():
            with _in_local_call(batch, plan, tuple(coupled)) as routing:
                with local_state.stateless_scope(mapping, True) as scope:
                    entered = dict(scope.state_mapping)
                    outputs = call_function(layer, *local_args, **local_kwargs)
    except coupled_layers.NotRows:
        return None, "a layer that couples samples returns other values", None
    variables = [v for v, _ in mapping]
    updated = [
        v for v in variables if scope.get_current_value(v) is not entered[id(v)]
    ]
    if batch_coupling.assigned_outside(scope, entered):
        return None, "assigns a variable outside the model", None
    if any(v.trainable for v in updated):
        return None, "assigns a trainable variable", None
    if not routing.added_only(scope.losses):
        return None, "adds a loss (taken over the global batch)", None
    leaves = [x for x in tree.flatten(outputs) if x is not None]
    if not all(_is_local_batch(x, batch) for x in leaves):
        return None, "its outputs on the local rows are not plain rows", None
    if not _same_losses(losses, routing.losses):
        return None, "its losses on the local rows differ from DTensor's", None
    if not all(
        batch_coupling.same(scope.get_current_value(v), v.value.to_local())
        for v in variables
        if not v.trainable
    ):
        return None, "its updates on the local rows differ from DTensor's", None
    return leaves, None, plan


def _same_losses(losses, local_losses):
    """Whether the coupled layers' losses of a probe's two calls agree."""
    return len(losses) == len(local_losses) and all(
        batch_coupling.same(coupled_layers.whole(a), coupled_layers.whole(b))
        for a, b in zip(losses, local_losses)
    )


def _call_locally(
    call_function, layer, inputs, batch, variables, verdict, step
):
    """Calls `layer` on the local rows of `inputs`; `None`, keeping nothing,
    if it must run through DTensor after all."""
    local_args, local_kwargs = tree.map_structure(_to_local, inputs)
    mapping = [(v, local_weight(v, step)) for v in variables]
    # A call dropped below must leave the generators as it found them.
    rng_states = generator_states.take()
    plan = verdict.draws.following()
    outputs, unseen = None, ""
    try:
        with runtime.distribution_suspended():
            with _in_local_call(batch, plan, verdict.coupled) as routing:
                with local_state.stateless_scope(mapping, True) as scope:
                    entered = dict(scope.state_mapping)
                    outputs = call_function(layer, *local_args, **local_kwargs)
    except coupled_layers.NotRows:
        unseen = "a layer that couples samples returns other values"
    leaves = [x for x in tree.flatten(outputs) if x is not None]
    updated = [
        (v, scope.get_current_value(v))
        for v in variables
        if scope.get_current_value(v) is not entered[id(v)]
    ]
    if not unseen and not all(_is_local_batch(x, batch) for x in leaves):
        unseen = "outputs that are not this process' rows"
    if not unseen:
        unseen = batch_coupling.unseen_by_probe(
            plan, rng_states, scope, entered, updated, routing
        )
    if batch.global_rows % batch.mesh.size():
        # Uneven row counts: processes may see different outcomes (draws,
        # coupled layers, outputs of another rank on a single row).
        unseen = batch_coupling.agreed_unseen(unseen, batch.mesh)
    if unseen:
        runtime.log_debug(
            "%s: through DTensor from now on: %s", layer.name, unseen
        )
        if step is not None:
            step.runs_through_dtensor = True
        generator_states.restore(rng_states)
        return None
    with torch.no_grad():
        for variable, value in updated:
            variable.value.to_local().copy_(value)
    coupled_layers.keep_losses(layer, scope.losses)

    def to_global(x):
        output = _to_global(x, batch)
        if step is not None:
            step.keep_local_output(output, x)
        return output

    return tree.map_structure(to_global, outputs)


@contextlib.contextmanager
def _in_local_call(batch, plan, coupled):
    _local_call.current = (batch.mesh.get_group(), batch.global_rows)
    try:
        with (
            random_draws.one_key_per_call(),
            random_draws.local_rows_scope(
                batch.start, batch.local_rows, batch.global_rows, plan
            ),
            coupled_layers.routed(coupled, batch) as routing,
        ):
            yield routing
    finally:
        _local_call.current = None


def local_call_group():
    """The mesh group of this thread's local-rows call, or `None`."""
    current = getattr(_local_call, "current", None)
    return None if current is None else current[0]


def local_variables(model, mesh):
    """`model`'s variables if all are replicated on the 1-D `mesh`."""
    variables = list(model.variables)
    if not all(coupled_layers.replicated_on(v.value, mesh) for v in variables):
        return None
    return variables


def classification_final(model):
    """Whether `local_variables`' answer for `model` is final (all built)."""
    return all(
        sublayer.built
        for sublayer in model._flatten_layers(include_self=True, recursive=True)
    )


def local_weight(variable, step):
    """A replicated weight's local value, its gradient a partial sum (the
    step's plain leaf in Keras' own train step)."""
    value = variable.value
    if not value.requires_grad:
        return value.to_local()
    leaf = None if step is None else step.local_leaf(variable)
    if leaf is not None:
        return leaf
    return value.to_local(grad_placements=[Partial()])


def _to_local(x):
    return x.to_local() if isinstance(x, DTensor) else x


def _is_local_batch(x, batch):
    """Whether `x` is a plain tensor of this process' rows (no DTensor op)."""
    return (
        hasattr(x, "shape")
        and not isinstance(x, DTensor)
        and x.ndim > 0
        and x.shape[0] == batch.local_rows
    )


def _to_global(x, batch):
    """A local output (and its mask) as the global batch's DTensor."""
    mask = get_keras_mask(x)
    output = _sharded(x, batch)
    if mask is not None:
        set_keras_mask(output, _sharded(mask, batch))
    return output


def _sharded(x, batch):
    shape = (batch.global_rows,) + tuple(x.shape[1:])
    return layouts.dtensor_from_local(
        x.contiguous(), batch.mesh, list(batch.placements), shape=shape
    )
