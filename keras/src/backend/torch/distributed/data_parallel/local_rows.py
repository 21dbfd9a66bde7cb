"""Model calls on each process' rows as plain tensors, without DTensor's per-op
dispatch, where the probe (`batch_coupling`) finds they give its numbers."""

import contextlib
import functools
import weakref

import torch

from keras.src import tree
from keras.src.backend.torch.distributed.core import collectives
from keras.src.backend.torch.distributed.core import generator_states
from keras.src.backend.torch.distributed.core import local_state
from keras.src.backend.torch.distributed.core import random_draws
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core import structures
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Partial
from keras.src.backend.torch.distributed.data_parallel import batch_coupling
from keras.src.backend.torch.distributed.data_parallel import coupled_layers
from keras.src.backend.torch.distributed.data_parallel import local_loss
from keras.src.backend.torch.distributed.data_parallel import local_metrics
from keras.src.backend.torch.distributed.data_parallel import row_boundary
from keras.src.backend.torch.distributed.dtensor_gaps import fallback
from keras.src.backend.torch.distributed.training import layer_call
from keras.src.backend.torch.distributed.training.step import running_step

# `{layer: {training: Verdict}}` for calls outside a step.
_verdicts = weakref.WeakKeyDictionary()
_DIFFERS = "its outputs on the local rows differ from DTensor's"


class StepRows:
    """A step function's record of its model's calls on local rows: the
    probe's verdicts, whether it runs through DTensor, and the local rows of
    the running step's outputs, which its loss reads."""

    def __init__(self, model):
        self.model = model
        # Set once a call on the rows must run through DTensor (`call`).
        self.runs_through_dtensor = False
        # The probe's `{training: Verdict}`; kept by `local_variables`.
        self.verdicts, self._variables, self._outputs = {}, (None, None), []
        # Whether compiled metrics update on the rows (`None`: not checked).
        self.metrics_on_rows = None
        # Whether a step may run on plain rows (`row_boundary`: the step
        # before did, or took every path that does), and the running one's
        # `Batch` if it does.
        self.boundary, self.batch = False, None

    def may_run_locally(self, mesh):
        """Whether the model may be called on the local rows of `mesh`."""
        if self.runs_through_dtensor or mesh.ndim != 1:
            return False
        return self.local_variables(mesh) is not None

    def local_variables(self, mesh):
        """`local_variables` of the model on `mesh`, kept once final."""
        if self._variables[0] is mesh:
            return self._variables[1]
        variables = local_variables(self.model, mesh)
        if classification_final(self.model):
            self._variables = (mesh, variables)
        return variables

    def keep_local_output(self, output, local):
        """Keeps, for this step, the plain `local` rows `output` was made of."""
        self._outputs.append((output, local))

    def compiled_loss(self, y, y_pred, sample_weight, step):
        """`local_loss.local_compiled_loss` of `step`'s outputs, or `None`."""
        local = next((x for o, x in self._outputs if o is y_pred), None)
        weight = functools.partial(local_weight, step=step)
        return local_loss.local_compiled_loss(
            self.model, y, y_pred, sample_weight, local, weight
        )

    def take_plain_rows(self, data, distribution, kind):
        """`data`, the global batch, as this process' plain rows for a step
        of Keras' own train or test step (`kind`) where the step before ran
        on the rows (`row_boundary`), setting `batch`; else `None`."""
        mesh = distribution.device_mesh.backend_mesh
        if not (
            self.boundary
            and self.may_run_locally(mesh)
            and row_boundary.keras_own_steps(self.model, kind)
        ):
            return None
        cut = row_boundary.plain_rows(data, distribution)
        if cut is None:
            return None
        data, self.batch = cut
        return data

    def as_global(self, values):
        """`row_boundary.as_global` of `values` in a step on plain rows: no
        later step runs on them."""
        self.boundary = False
        return row_boundary.as_global(values, self.batch)

    def global_counts(self, tracker):
        """`row_boundary.global_counts` of the running step's batch."""
        return row_boundary.global_counts(tracker, self.batch)

    def global_updates(self, metrics):
        """`row_boundary.global_updates` of the running step's batch."""
        self.boundary = False
        return row_boundary.global_updates(metrics, self.batch)

    def plain_batch(self, values):
        """The running step's `Batch` of plain rows if `values` hold no
        `DTensor`, else `None`."""
        if self.batch is None:
            return None
        leaves = structures.flatten(values)
        if any(isinstance(x, DTensor) for x in leaves):
            return None
        return self.batch

    def rows_loss(self, y, y_pred, sample_weight, step):
        """`local_loss.rows_compiled_loss` of a step on plain rows, or
        `None`."""
        weight = functools.partial(local_weight, step=step)
        return local_loss.rows_compiled_loss(
            self.model, y, y_pred, sample_weight, self.batch, weight
        )

    # The compiled metrics' update on the rows (`local_metrics`).
    compiled_metrics = local_metrics.compiled_metrics
    add_metrics = local_metrics.add_with_gradients

    def finish(self):
        """Forgets the running step's outputs and batch."""
        self._outputs.clear()
        self.batch = None


def call(call_function, layer, args, kwargs, through):
    """Outermost `layer`'s batch-sharded outputs from the local rows where they
    are DTensor's, else `None` (`through(args, kwargs)`: the DTensor call)."""
    step, inputs = running_step(layer), (args, kwargs)
    rows = None if step is None else step.rows
    if rows is not None and rows.batch is not None and layer is step.model:
        return _plain_rows_call(call_function, layer, inputs, through, step)
    batch = coupled_layers.batch_of(inputs)
    if batch is None or (rows is not None and rows.runs_through_dtensor):
        return None
    if rows is None:
        variables = local_variables(layer, batch.mesh)
        verdicts = _verdicts.setdefault(layer, {})
    else:
        variables, verdicts = rows.local_variables(batch.mesh), rows.verdicts
    training = bool(kwargs.get("training"))
    verdict = verdicts.get(training)
    if variables is None or (verdict is not None and not verdict.per_sample):
        return None
    on_rows = functools.partial(_on_rows, call_function, layer, inputs, batch)
    if verdict is not None:
        return _call_locally(on_rows, layer, batch, variables, verdict, step)
    if not classification_final(layer):
        return None
    outputs, verdict = _probe(on_rows, through, inputs, layer, batch, variables)
    if verdict is not None:
        verdicts[training] = verdict
        if rows is not None and not verdict.per_sample:
            rows.runs_through_dtensor = True
        runtime.log_debug("%s: %s", layer.name, verdict)
    return outputs


def _plain_rows_call(call_function, layer, inputs, through, step):
    """The model's call in a step on plain rows (`row_boundary`): its plain
    outputs on the rows, or `through` DTensor on the global batch."""
    rows, batch = step.rows, step.rows.batch
    verdict = rows.verdicts.get(bool(inputs[1].get("training")))
    variables = rows.local_variables(batch.mesh)
    outputs = None
    if (
        verdict is not None
        and verdict.per_sample
        and variables is not None
        and not rows.runs_through_dtensor
    ):
        on_rows = functools.partial(
            _on_rows, call_function, layer, inputs, batch
        )
        outputs = _call_locally(
            on_rows, layer, batch, variables, verdict, step, plain=True
        )
    if outputs is None:
        outputs = through(*rows.as_global(inputs))
    return outputs


def _probe(on_rows, through, inputs, layer, batch, variables):
    """Calls `layer` through DTensor, then on the local rows with its draws:
    `(DTensor outputs, Verdict)`, the verdict `None` if it built a layer."""
    before = [(v, v.value.to_local().clone()) for v in variables]
    rng_states = generator_states.take()
    watch = batch_coupling.PartialWatch()
    # The fallback's modes first: in a step they stay on past the watch.
    with batch_coupling.recording() as dtensor_calls:
        with fallback.dtensor_fallback(), watch:
            outputs = through(*inputs)
    if len(layer.variables) != len(variables):
        return outputs, None
    own_rows = functools.partial(_own_rows, batch=batch)
    rows = [own_rows(x) for x in tree.flatten(outputs) if x is not None]
    coupled = batch_coupling.coupling_layers(layer, watch)
    if coupled is None or any(x is None for x in rows):
        reason = batch_coupling.model_reason(watch, coupled)
        batch_coupling.agreed(reason, batch.mesh)  # Others may probe on.
        return outputs, batch_coupling.Verdict(False, reason)
    after = generator_states.take()
    layers, why = list(coupled[0]), coupled[1]
    while True:
        generator_states.restore(rng_states)
        with batch_coupling.recording() as local_calls:
            reason, plan = _checking_call(on_rows, before, layers, rows, after)
        differing = -1
        if reason == _DIFFERS:
            differing = batch_coupling.first_differing_layer(
                layer, dtensor_calls, local_calls, own_rows, layers
            )
        reason, position = batch_coupling.agreed(reason, batch.mesh, differing)
        if position < 0:
            break
        layers.append(list(layer._flatten_layers(include_self=False))[position])
        mixes = "its outputs on the local rows differ"
        why = f"{why}, {mixes}" if why else mixes
    generator_states.restore(after)
    if reason is not None:
        return outputs, batch_coupling.Verdict(False, reason)
    plan.python_draws = generator_states.python_advanced(rng_states, after)
    return outputs, batch_coupling.Verdict(True, why, plan, tuple(layers))


def _own_rows(x, batch):
    """This process' rows of a probe's output (cut if whole), or `None`."""
    if (
        isinstance(x, DTensor)
        and x.device_mesh == batch.mesh
        and x.shape[:1] == (batch.global_rows,)
    ):
        if tuple(x.placements) == batch.placements:
            return x.to_local()
        if all(p.is_replicate() for p in x.placements):
            return x.to_local()[batch.start : batch.start + batch.local_rows]
    return None


def _on_rows(call_fn, layer, inputs, batch, mapping, plan, coupled, key=None):
    """Calls `layer` on the local rows from `mapping`, `coupled` layers through
    DTensor (`key`: of `random_draws.start_key`): `(outputs, scope, Routing,
    updates, why DTensor's may differ)`."""
    args, kwargs = structures.map_structure(local_state.local_value, inputs)
    try:
        with (
            # The probe's check keeps nothing, and compares its outputs with
            # DTensor's: with DTensor's kernels.
            torch.no_grad() if plan.recording else contextlib.nullcontext(),
            contextlib.nullcontext()
            if plan.recording
            else layer_call.plain_tensor_kernels(),
            runtime.distribution_suspended(),
            random_draws.one_key_per_call(key),
            random_draws.local_rows_scope(
                batch.start, batch.local_rows, batch.global_rows, plan
            ),
            coupled_layers.routed(coupled, batch) as routing,
            local_state.stateless_scope(mapping, True) as scope,
        ):
            entered = dict(scope.state_mapping)
            outputs = call_fn(layer, *args, **kwargs)
    except coupled_layers.NotRows as error:
        outputs = error
    updated = [(v, scope.get_current_value(v)) for v, _ in mapping]
    updated = [(v, x) for v, x in updated if x is not entered[id(v)]]
    leaves = [x for x in structures.flatten(outputs) if x is not None]
    reason = None
    if isinstance(outputs, coupled_layers.NotRows):
        reason = "a layer that couples samples returns other values"
    elif any(key not in entered for key in scope.state_mapping):
        reason = "assigns a variable outside the model"
    elif any(v.trainable for v, _ in updated):
        reason = "assigns a trainable variable"
    elif not set(map(id, scope.losses)) <= set(map(id, routing.losses)):
        reason = "adds a loss (taken over the global batch)"
    elif not all(coupled_layers.is_rows(x, batch) for x in leaves):
        reason = "its outputs on the local rows are not plain rows"
    return outputs, scope, routing, updated, reason


def _checking_call(on_rows, mapping, coupled, rows, after):
    """The probe's call on the local rows from `mapping`, keeping nothing: `(why
    its rows, losses, updates or draws differ from DTensor's or None, plan)`."""
    # The `coupled` layers' losses from the DTensor call.
    losses = [x for c in coupled for x in c._get_own_losses()]
    plan = random_draws.DrawPlan()
    outputs, scope, routing, _, reason = on_rows(mapping, plan, tuple(coupled))
    same, whole = batch_coupling.same, coupled_layers.whole
    if reason is not None:
        return reason, plan
    if len(losses) != len(routing.losses) or not all(
        same(whole(a), whole(b)) for a, b in zip(losses, routing.losses)
    ):
        return "its losses on the local rows differ from DTensor's", plan
    if not all(
        same(scope.get_current_value(v), v.value.to_local())
        for v, _ in mapping
        if not v.trainable
    ):
        return "its updates on the local rows differ from DTensor's", plan
    if generator_states.differ(after, generator_states.take()):
        return "draws from a global generator otherwise on its rows", plan
    leaves = [x for x in tree.flatten(outputs) if x is not None]
    if len(leaves) != len(rows):
        return "its outputs on the local rows differ in shape", plan
    return (None if all(map(same, rows, leaves)) else _DIFFERS), plan


def _call_locally(on_rows, layer, batch, variables, verdict, step, plain=False):
    """Calls `layer` on the local rows (`on_rows`), its outputs the global
    batch's (`plain`: the rows' as they are); `None`, keeping nothing, if it
    must run through DTensor after all."""
    mapping = [(v, local_weight(v, step)) for v in variables]
    plan, key = verdict.draws.following(), None
    if verdict.draws.unseeded:
        # The probe's call took an unseeded key: agreed during the call (a
        # call dropped below leaves it drawn, alike on every process).
        key = random_draws.start_key()
    # A call dropped below must leave the generators as it found them.
    rng_states = generator_states.take()
    outputs, scope, _, updated, why = on_rows(
        mapping, plan, verdict.coupled, key
    )
    if why is None and plan.broken:
        why = "a random draw of another shape than the probe's"
    if why is None and generator_states.advanced(rng_states, plan.python_draws):
        why = "a draw from a global generator"
    # Uneven row counts: processes may see different outcomes (draws,
    # coupled layers, outputs of another rank on a single row).
    uneven = batch.global_rows % batch.mesh.size()
    if uneven and collectives.any_process(why, batch.mesh.get_group()):
        why = why or "another process' call did what the probe did not find"
    if why:
        runtime.log_debug(
            "%s: through DTensor from now on: %s", layer.name, why
        )
        if step is not None and step.rows is not None:
            step.rows.runs_through_dtensor = True
        generator_states.restore(rng_states)
        return None
    with torch.no_grad():
        for variable, value in updated:
            variable.value.to_local().copy_(value)
    coupled_layers.keep_losses(layer, scope.losses)
    if plain:
        return outputs

    def to_global(x):
        output = coupled_layers.with_mask(coupled_layers.sharded, x, batch)
        if step is not None and step.rows is not None:
            step.rows.keep_local_output(output, x)
        return output

    return structures.map_structure(to_global, outputs)


def local_variables(model, mesh):
    """`model`'s variables if all are replicated on the 1-D `mesh`."""
    variables = list(model.variables)
    replicated = all(
        isinstance(v.value, DTensor)
        and v.value.device_mesh == mesh
        and all(p.is_replicate() for p in v.value.placements)
        for v in variables
    )
    return variables if replicated else None


def classification_final(model):
    """Whether `local_variables`' answer for `model` is final (all built)."""
    return all(
        sublayer.built
        for sublayer in model._flatten_layers(include_self=True, recursive=True)
    )


def local_weight(variable, step):
    """A replicated weight's local value, its gradient a partial sum (the
    step's plain leaf in Keras' own train step); the variable's own tensor,
    which the layers' reads through the stateless scope autocast."""
    value = variable._value
    if not value.requires_grad:
        # Kept across calls: `to_local` would run an autograd function.
        return local_state.replicated_local(value)
    leaf = None if step is None else step.local_leaf(variable, value)
    return value.to_local(grad_placements=[Partial()]) if leaf is None else leaf
