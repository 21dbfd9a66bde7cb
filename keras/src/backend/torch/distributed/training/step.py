"""The training step as one object, `DistributedStep`, set on its model while
it runs, where the train step's hooks below find it. Techniques add to the step
through `techniques`, set by `distribution_lib`."""

import contextlib
import dataclasses
import functools
import types

import torch

from keras.src import tree
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import local_state
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import Partial
from keras.src.backend.torch.distributed.dtensor_gaps import fallback
from keras.src.backend.torch.distributed.health import call_agreement
from keras.src.backend.torch.distributed.health import health
from keras.src.backend.torch.distributed.inputs import data_input
from keras.src.backend.torch.distributed.training import compiled_step
from keras.src.backend.torch.distributed.training import layer_call
from keras.src.backend.torch.distributed.training import step_reduction


@dataclasses.dataclass
class Techniques:
    """What techniques add to each step (the defaults add nothing): `rows`,
    the step's record of calls on each process' rows (`local_rows.StepRows`);
    `context`, around each eager step; `eager_reason`, why a compiled step
    must run eagerly; `predictions`, as the loss and metrics read them."""

    rows: object = lambda model: None
    context: object = lambda step, distribution: contextlib.nullcontext()
    eager_reason: object = lambda model, distribution: None
    predictions: object = lambda model, y, y_pred: y_pred


# Set once, by `distribution_lib` as it composes the techniques.
techniques = Techniques()


def model_steps(model):
    """`model`'s `DistributedStep`s `by_kind` and the `running` one."""
    if getattr(model, "_distributed_steps", None) is None:
        steps = types.SimpleNamespace(by_kind={}, running=None)
        model._distributed_steps = steps
    return model._distributed_steps


def running_step(model):
    """The `DistributedStep` now running a step of `model`, or `None`."""
    return getattr(getattr(model, "_distributed_steps", None), "running", None)


class DistributedStep:
    """A train, test or predict step function run under the distribution; a
    compiled one runs eagerly where a variable or batch is sharded unevenly,
    or once its first call failed (processes decide alike, on global shapes)."""

    def __init__(self, model, kind, step_function, eager_step_function):
        from keras.src.models.model import Model

        self.model, self.kind = model, kind
        # Reached via the model whatever the trainer does with the step.
        model_steps(model).by_kind[kind] = self
        self.step_function = step_function
        eager = self.eager_step_function = eager_step_function
        functools.update_wrapper(self, eager)
        self._unchecked = step_function is not eager  # Compiled, not yet run.
        self._distributed_function = eager
        if self._unchecked:
            self._distributed_function = compiled_step.compile_step(eager)
        # Keras' own train step: buckets all-reduced during its one backward.
        self._overlaps_reduction = (
            kind == "train" and type(model).train_step is Model.train_step
        )
        # Keras' own test step: its metrics' sums reduced in one collective.
        self._defers_sums = (
            kind == "test" and type(model).test_step is Model.test_step
        )
        self.rows = techniques.rows(model)
        # Kept across steps: plain leaves, bucket plans.
        self._leaves, self._buckets = step_reduction.KeptLeaves(), {}
        # Of the running step (`_eager_step`); its loss if a plain term; the
        # loss' inputs, kept for the metrics (`keep_metric_inputs`).
        self._reduction, self._fallback_on, self._loss_term = None, None, None
        self._metric_inputs = None

    def __call__(self, data):
        distribution = runtime.current_distribution()
        if distribution is None:
            return self.step_function(data)
        call_agreement.start()
        with health.guarded_step(self.kind, layouts.all_process_groups):
            steps = model_steps(self.model)
            previous, steps.running = steps.running, self
            try:
                return self._run(data, distribution)
            finally:
                steps.running = previous
                if self.rows is not None:
                    self.rows.finish()

    def _run(self, data, distribution):
        model, eager = self.model, self.eager_step_function
        if self._unchecked:
            # Built eagerly: the loss' and metrics' lazy build breaks dynamo.
            model._symbolic_build(data_batch=data[0])
            reason = compiled_step.eager_reason(model)
            reason = reason or techniques.eager_reason(model, distribution)
            if reason is not None:
                compiled_step.warn_eager(reason)
                self._distributed_function, self._unchecked = eager, False
        rows = self._plain_rows(data, distribution)
        data = rows or data_input.distribute_global_batch(data, distribution)
        # On plain rows, calls on DTensors within (a fallback) take math SDPA.
        with layer_call.replicated_plain_tensors(math_sdpa=rows is None):
            function = self._distributed_function
            if function is eager or not compiled_step.evenly_sharded(data):
                return self._eager_step(data, distribution)
            if not self._unchecked:
                return compiled_step.run(function, model, data)
            self._unchecked = False
            try:
                return compiled_step.run_first(function, model, data)
            except compiled_step.CompileFailed:
                self._distributed_function = eager
                return self._eager_step(data, distribution)

    def _plain_rows(self, data, distribution):
        """`data` as this process' plain rows where this eager train or test
        step takes them (`StepRows.take_plain_rows`), else `None`."""
        mesh = distribution.device_mesh.backend_mesh
        if not (
            self.rows is not None
            and (self._overlaps_reduction or self._defers_sums)
            and mesh.ndim == 1
            and self._distributed_function is self.eager_step_function
        ):
            return None
        return self.rows.take_plain_rows(data, distribution, self.kind)

    def _eager_step(self, data, distribution):
        """Runs an eager step, DTensor's refusals computed on global values
        (lazily where the model may run on local rows)."""
        mesh = distribution.device_mesh.backend_mesh
        lazy = self.rows is not None and self.rows.may_run_locally(mesh)
        reduction = contextlib.nullcontext()
        if self._overlaps_reduction:
            reduction = step_reduction.overlapped_reduction(
                self.model, self._leaves, self._buckets, lazy
            )
        elif self._defers_sums and mesh.ndim == 1:
            reduction = step_reduction.deferred_sums(mesh)
        with (
            fallback.dtensor_fallback(lazy=lazy) as self._fallback_on,
            techniques.context(self, distribution),
            reduction as self._reduction,
        ):
            try:
                return self.eager_step_function(data)
            finally:
                self._fallback_on = self._reduction = self._loss_term = None

    def local_leaf(self, variable, value):
        """The plain leaf for a weight (`value`) in a local-rows call, or
        `None`."""
        return self._reduction and self._reduction.local_leaf(variable, value)

    def keep_metric_inputs(self, inputs):
        """Keeps the loss' inputs, `(y, y_pred, sample_weight)`, for the
        metrics, whose sums on the rows join the gradients' where they can."""
        reduction, rows = self._reduction, self.rows
        if rows is not None and rows.batch is not None:
            if rows.plain_batch(inputs) is None:  # The model's call was not.
                inputs = rows.as_global(inputs)
        added = reduction and rows and rows.add_metrics(inputs, reduction.defer)
        self._metric_inputs = (inputs, bool(added))

    def local_compiled_loss(self, y, y_pred, sample_weight):
        """See `local_loss` (the hook)."""
        rows = self.rows
        if rows is not None and rows.batch is not None:
            return self._plain_rows_loss(y, y_pred, sample_weight)
        loss = rows and rows.compiled_loss(y, y_pred, sample_weight, self)
        if loss is None:
            if self._fallback_on is not None:
                self._fallback_on()  # Keras computes it through DTensor.
            return None
        return self._loss_of_share(*loss, y_pred.device_mesh)

    def _plain_rows_loss(self, y, y_pred, sample_weight):
        """The compiled loss of a step on plain rows (`row_boundary`): from the
        rows, else Keras' on the global batch's DTensors of them."""
        rows = self.rows
        share = rows.rows_loss(y, y_pred, sample_weight, self)
        if share is not None:
            return self._loss_of_share(share, [Partial()], rows.batch.mesh)
        y, y_pred, sample_weight = rows.as_global((y, y_pred, sample_weight))
        loss = rows.compiled_loss(y, y_pred, sample_weight, self)
        if loss is not None:
            return self._loss_of_share(*loss, y_pred.device_mesh)
        if self._fallback_on is not None:
            self._fallback_on()
        return self.model._compute_loss(
            y=y,
            y_pred=y_pred,
            sample_weight=sample_weight,
            training=self.kind == "train",
        )

    def _loss_of_share(self, share, placements, mesh):
        """The loss of this process' `share` of it: the plain term where the
        step sums it (with the gradients) and no optimizer scales it by a
        variable (its backward then needs no DTensor), else a DTensor."""
        from keras.src.optimizers.base_optimizer import BaseOptimizer

        optimizer = self.model.optimizer
        scales = getattr(type(optimizer), "scale_loss", None)
        if (
            placements == [Partial()]
            and self._reduction is not None
            and scales in (None, BaseOptimizer.scale_loss)
        ):
            self._loss_term = (share, mesh)
            return share
        return layouts.dtensor_from_local(share, mesh, placements)

    def reduce_gradients(self, gradients):
        """See `reduce_gradients` (the hook)."""
        return step_reduction.reduce_step_gradients(
            self._reduction, self.model.optimizer, gradients
        )


def model_step(model, kind):
    """The `DistributedStep` last built for `model`'s `kind`, or `None`."""
    return model_steps(model).by_kind.get(kind)


def loss_predictions(model, y, y_pred):
    """`y_pred` as a step's loss and metrics read it (a sharded class axis
    gathered where the compiled loss would)."""
    if running_step(model) is None:
        return y_pred
    return techniques.predictions(model, y, y_pred)


def local_loss(model, y, y_pred, sample_weight):
    """A train or test step's compiled loss on local tensors, or `None`
    (outside a step, or where local tensors can't give DTensor's numbers)."""
    step = running_step(model)
    if step is None:
        return None
    if not torch.compiler.is_compiling():
        step.keep_metric_inputs((y, y_pred, sample_weight))
    return step.local_compiled_loss(y, y_pred, sample_weight)


def metric_predictions(model, y_pred):
    """The predictions a train step gives its metrics, detached when compiled:
    outputs that require gradients but get none from `loss.backward()` fail
    AOTAutograd ("Expected a DTensor tangent but got a plain Tensor")."""
    step = running_step(model)
    if step is None or not torch.compiler.is_compiling():
        return y_pred
    return tree.map_structure(
        lambda x: x.detach() if isinstance(x, torch.Tensor) else x, y_pred
    )


def reduce_gradients(model, gradients):
    """A train step's `gradients`, reduced once in buckets in a step."""
    step = running_step(model)
    return gradients if step is None else step.reduce_gradients(gradients)


def local_metric_state(model, metric, value=None):
    """A context running `metric`'s update in a step on its replicated state's
    local values, yielding the value the update reads; the loss tracker's
    partial loss is reduced with the gradients' last bucket."""
    step = running_step(model)
    if step is None:
        return contextlib.nullcontext(value)
    defer = getattr(step._reduction, "defer", None)
    term = step._loss_term
    mesh = term[1] if term is not None and value is term[0] else None
    context = local_state.local_metric_state(metric, defer, value, mesh)
    if step.rows is None or step.rows.batch is None:
        return context
    return _within(step.rows.global_counts(metric), context)


@contextlib.contextmanager
def _within(outer, context):
    """`context` entered within `outer`, yielding what `context` yields."""
    with outer, context as value:
        yield value


def local_metric_reads(model, metric):
    """A context reading `metric`'s replicated state locally in a step; in
    Keras' own train step, the compiled metrics updated on the local rows
    where they only sum over them (`local_metrics`)."""
    step = running_step(model)
    if step is None:
        return contextlib.nullcontext()
    if step._reduction is not None:
        step._reduction.flush()  # The step's deferred sums, before reads.
    kept, step._metric_inputs = step._metric_inputs, None
    rows = step.rows
    if kept is None or rows is None:
        return local_state.local_reads(metric.variables)
    context = rows.compiled_metrics(metric, *kept)
    compiled, added = model._compile_metrics, kept[1]
    # Whether every reader of the batch took local rows: the next step may
    # run on plain rows (not after a step on them that could not).
    took_rows = step._loss_term is not None and (added or compiled is None)
    plain = rows.batch is not None
    rows.boundary = took_rows and (rows.boundary or not plain)
    if not plain or added or compiled is None:
        return context
    return _within(rows.global_updates(compiled), context)
