"""The training step as one object: a step function under the distribution.

The torch trainer builds a `DistributedStep` once per step function
(`make_train_function`, `make_test_function`, `make_predict_function`),
from the model; it is the step function the trainer calls. Without a
distribution it calls the step as it is. Under one, it distributes each
global batch (see `data_input`), runs the step with plain tensors taken as
replicated global values (see `layer_call`), and decides for its model:

- the path: a model of Keras' own per-sample layers under data parallelism
  is called on each process' rows as plain tensors (see `local_rows`),
  others through DTensor, whose refusals are computed on global values
  (see `fallback`); a model whose call drew random numbers or assigned a
  trainable variable in this step function runs through DTensor from
  then on (`runs_through_dtensor`);
- the reductions: in Keras' own eager train step, gradient buckets are
  all-reduced while the backward pass runs, the weights of a call on the
  local rows entering as plain leaves, and the last bucket is reduced with
  the loss (see `step_reduction`);
- the loss: a built-in per-sample loss computed on each process' rows
  (see `local_loss`), and the loss tracker updated on local values;
- compiled (`jit_compile=True`): see `compiled_step`.

While it runs, the step is set on its model (`local_rows.running_step`):
the trainer's train step and the model's call reach it from the model they
have, through the hooks below. A step keeps its state on itself; the
gradient hooks that autograd runs (on threads of its own on CUDA devices)
hold the step's reduction, not a lookup.
"""

import contextlib
import functools

import torch

from keras.src import tree
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import local_state
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.data_parallel import (
    local_loss as local_loss_lib,
)
from keras.src.backend.torch.distributed.data_parallel import local_rows
from keras.src.backend.torch.distributed.dtensor_gaps import fallback
from keras.src.backend.torch.distributed.fsdp import fsdp_schedule
from keras.src.backend.torch.distributed.health import call_agreement
from keras.src.backend.torch.distributed.health import health
from keras.src.backend.torch.distributed.inputs import data_input
from keras.src.backend.torch.distributed.training import compiled_step
from keras.src.backend.torch.distributed.training import layer_call
from keras.src.backend.torch.distributed.training import step_reduction


class DistributedStep:
    """A train, test or predict step function, run under the distribution.

    Args:
        model: the model the step belongs to.
        kind: `"train"`, `"test"` or `"predict"`.
        step_function: a function of `data`, a list holding one global
            batch; possibly compiled with `torch.compile`.
        eager_step_function: the same function, not compiled.

    Called with `data`, it returns what `step_function` returns. Under a
    distribution, a compiled step is compiled anew with static shapes (see
    `compiled_step.compile_step`). Where a variable or a batch is sharded
    unevenly, the step runs eagerly: compiled code assumes equal shards
    (torch 2.13). If the compiled step fails on its first call, it warns
    once, restores the state the attempt may have changed, and runs
    eagerly from then on. All processes take the same path, as they decide
    on global shapes.

    Attributes:
        runs_through_dtensor: whether a call of the model on the local rows
            drew random numbers or assigned a trainable variable in this
            step function; it then runs through DTensor, which draws one
            process' numbers for the global batch and assigns global
            values.
    """

    def __init__(self, model, kind, step_function, eager_step_function):
        self.model = model
        self.kind = kind
        # Reached the same way whatever the trainer does with the step
        # (see `model_step`).
        local_rows.model_steps(model).by_kind[kind] = self
        self.step_function = step_function
        self.eager_step_function = eager_step_function
        functools.update_wrapper(self, eager_step_function)
        # A compiled step is checked on its first call.
        self._unchecked = step_function is not eager_step_function
        self._distributed_function = eager_step_function
        if self._unchecked:
            self._distributed_function = compiled_step.compile_step(
                eager_step_function
            )
        # Keras' own train step takes one backward pass, then reduces its
        # gradients in `reduce_gradients`: its buckets can be all-reduced
        # while that pass runs.
        self._overlaps_reduction = kind == "train" and _default_train_step(
            model
        )
        self.runs_through_dtensor = False
        # What the probe found of the model's calls in this step function
        # (`local_rows.call`): `{training: batch_coupling.Verdict}`.
        self.verdicts = {}
        # `(mesh, variables)`: what `local_rows.local_variables` said of the
        # model once it was built (see `local_variables`).
        self._local_variables = None
        # The plain leaves standing for the weights, kept from one step to
        # the next (see `step_reduction.OverlappedReduction.local_leaf`).
        self._leaves = {}
        # The buckets of the overlapped reduction, kept from one step to
        # the next (see `step_reduction.overlapped_reduction`).
        self._buckets = {}
        # Of the step running now: its overlapped reduction, and the
        # `(output, local tensor)` of the model's calls on the local rows.
        self._reduction = None
        self._local_outputs = []
        # Turns the step's lazily entered fallback on (see `_eager_step`).
        self._fallback_on = None
        # The order of the gathers of weights sharded over the batch axis,
        # learned from one step for the next (see `fsdp_schedule`).
        self._gathers = fsdp_schedule.GatherSchedule()

    def __call__(self, data):
        distribution = runtime.current_distribution()
        if distribution is None:
            return self.step_function(data)
        call_agreement.start()
        with health.guarded_step(self.kind, layouts.all_process_groups):
            with self._running():
                return self._run(data, distribution)

    @contextlib.contextmanager
    def _running(self):
        """Sets this step on its model while it runs."""
        steps = local_rows.model_steps(self.model)
        previous, steps.running = steps.running, self
        try:
            yield
        finally:
            steps.running = previous
            self._local_outputs.clear()

    def _run(self, data, distribution):
        model = self.model
        if self._unchecked:
            # Built eagerly, on the global batch: traced, the lazy build of
            # the loss and metrics breaks dynamo.
            model._symbolic_build(data_batch=data[0])
            reason = compiled_step.eager_reason(model)
            if reason is not None:
                compiled_step.warn_eager(reason)
                self._distributed_function = self.eager_step_function
                self._unchecked = False
        data = data_input.distribute_global_batch(data, distribution)
        with layer_call.replicated_plain_tensors():
            function = self._distributed_function
            if function is self.eager_step_function or (
                not compiled_step.evenly_sharded(data)
            ):
                return self._eager_step(data)
            if not self._unchecked:
                return compiled_step.run(function, model, data)
            self._unchecked = False
            try:
                return compiled_step.run_first(function, model, data)
            except compiled_step.CompileFailed:
                self._distributed_function = self.eager_step_function
                return self._eager_step(data)

    def _eager_step(self, data):
        """Runs an eager step; Keras' own train step reduces during backward.

        Ops that DTensor refuses, forward or backward, are computed on
        global values (see `fallback`); a model that runs on the local rows
        runs its plain tensors without that mode's cost.
        """
        with (
            fallback.dtensor_fallback(
                lazy=self._may_run_locally()
            ) as self._fallback_on,
            fsdp_schedule.following(
                self._gathers, runtime.current_distribution()
            ),
        ):
            try:
                return self._step_reducing(data)
            finally:
                self._fallback_on = None

    def _step_reducing(self, data):
        """The step function, its gradients reduced as Keras' own train
        step computes them (see `step_reduction`)."""
        if not self._overlaps_reduction:
            return self.eager_step_function(data)
        with step_reduction.overlapped_reduction(
            self.model, self._leaves, self._buckets
        ) as reduction:
            self._reduction = reduction
            try:
                return self.eager_step_function(data)
            finally:
                self._reduction = None

    def _may_run_locally(self):
        """Whether the model may be called on the local rows (before the
        call): a data-parallel (1-D) mesh, and see `local_variables`."""
        if self.runs_through_dtensor:
            return False
        mesh = runtime.current_distribution().device_mesh.backend_mesh
        return mesh.ndim == 1 and self.local_variables(mesh) is not None

    def local_variables(self, mesh):
        """`local_rows.local_variables` of the model, decided once.

        The model's layers are walked and its variables' layouts checked
        on every call until the model is built (see
        `local_rows.classification_final`); then the answer is kept for
        this step function, as long as the batch comes on the same mesh.

        Args:
            mesh: the mesh the batch is sharded over.

        Returns:
            The model's variables, or `None` if the model cannot be called
            on the local rows.
        """
        kept = self._local_variables
        if kept is not None and kept[0] is mesh:
            return kept[1]
        variables = local_rows.local_variables(self.model, mesh)
        if local_rows.classification_final(self.model):
            self._local_variables = (mesh, variables)
        return variables

    def local_leaf(self, variable):
        """The plain leaf standing for a weight in a call on the local rows.

        Args:
            variable: a trainable variable, replicated on a 1-D mesh.

        Returns:
            A leaf tensor in Keras' own eager train step (see
            `step_reduction.OverlappedReduction.local_leaf`), else `None`.
        """
        if self._reduction is None:
            return None
        return self._reduction.local_leaf(variable)

    def keep_local_output(self, output, local):
        """Keeps, for this step, the local tensor a model output came from.

        Args:
            output: a batch-sharded output of a call on the local rows.
            local: the plain tensor of this process' rows it was made of.
        """
        self._local_outputs.append((output, local))

    def local_output(self, x):
        """The local tensor kept for `x` in this step, or `None`."""
        for output, local in self._local_outputs:
            if output is x:
                return local
        return None

    def local_compiled_loss(self, y, y_pred, sample_weight):
        """See `local_loss` (the hook)."""
        loss = local_loss_lib.local_compiled_loss(
            self.model,
            y,
            y_pred,
            sample_weight,
            self.local_output(y_pred),
            functools.partial(local_rows.local_weight, step=self),
        )
        if loss is None and self._fallback_on is not None:
            # Keras computes the loss through DTensor.
            self._fallback_on()
        return loss

    def metric_predictions(self, y_pred):
        """See `metric_predictions` (the hook)."""
        if not torch.compiler.is_compiling():
            return y_pred
        return tree.map_structure(
            lambda x: x.detach() if isinstance(x, torch.Tensor) else x, y_pred
        )

    def local_metric_state(self, metric):
        """See `local_metric_state` (the hook): in Keras' own train step
        the partial loss the tracker meets is reduced with the gradients'
        last bucket (`OverlappedReduction.defer`)."""
        defer = None if self._reduction is None else self._reduction.defer
        return local_state.local_metric_state(metric, defer)

    def reduce_gradients(self, gradients):
        """See `reduce_gradients` (the hook)."""
        return step_reduction.reduce_step_gradients(
            self._reduction, self.model.optimizer, gradients
        )


def call_verdict(model, kind=None, training=False):
    """What the probe found of `model`'s calls (see `local_rows.call`).

    Args:
        model: the model.
        kind: the step function whose calls (`"train"`, `"test"`,
            `"predict"`), or `None` for calls outside a step.
        training: the calls' `training` argument.

    Returns:
        A `batch_coupling.Verdict`, or `None` before a probe.
    """
    if kind is None:
        return local_rows.verdict(model, training)
    step = model_step(model, kind)
    return None if step is None else step.verdicts.get(bool(training))


def model_step(model, kind):
    """The `DistributedStep` of one of `model`'s step functions.

    On Keras 3.15.1 it is the step function itself
    (`model.train_function`); Keras master's trainer loops over its
    `steps_per_execution` batches itself and calls the step on each from
    inside its own function (`distribution_lib.batch_step`).

    Args:
        model: the model.
        kind: `"train"`, `"test"` or `"predict"`.

    Returns:
        The step the trainer built last for that step function, or `None`
        before it built one.
    """
    return local_rows.model_steps(model).by_kind.get(kind)


def loss_predictions(model, y, y_pred):
    """The model's outputs as a train or test step's loss and metrics read
    them.

    Args:
        model: the model being trained or evaluated.
        y: the targets.
        y_pred: the model's outputs.

    Returns:
        `y_pred` itself outside a step under a distribution, else with a
        class axis sharded over the mesh gathered where the compiled loss
        would gather it (see `local_loss.gathered_predictions`).
    """
    if local_rows.running_step(model) is None:
        return y_pred
    return local_loss_lib.gathered_predictions(model, y, y_pred)


def local_loss(model, y, y_pred, sample_weight):
    """The train step's compiled loss, computed on local tensors.

    Args:
        model: the model being trained.
        y: the targets.
        y_pred: the model's outputs.
        sample_weight: the sample weights, or `None`.

    Returns:
        `None` outside a step under a distribution, or where the loss cannot
        be computed on local tensors with DTensor's numbers (the caller then
        computes it as Keras does); else the loss (see
        `local_loss.local_compiled_loss`).
    """
    step = local_rows.running_step(model)
    if step is None:
        return None
    return step.local_compiled_loss(y, y_pred, sample_weight)


def metric_predictions(model, y_pred):
    """The predictions a train step gives its metrics, after the loss.

    Compiled under a distribution they are detached: the forward part of
    the step would otherwise return them as outputs that require gradients
    but get none from `loss.backward()`, and AOTAutograd fails on the
    missing `DTensor` gradient ("Expected a DTensor tangent but got a
    plain Tensor"). Metrics take no gradients, so the values are the same.

    Args:
        model: the model being trained.
        y_pred: the model's outputs (a nested structure of tensors).

    Returns:
        `y_pred` itself unless compiled under a distribution, else its
        detached tensors.
    """
    step = local_rows.running_step(model)
    if step is None:
        return y_pred
    return step.metric_predictions(y_pred)


def reduce_gradients(model, gradients):
    """Reduces a train step's gradients once, in buckets.

    Args:
        model: the model being trained.
        gradients: list of gradients, in the order of the model's trainable
            weights.

    Returns:
        The gradients: as they are outside a step under a distribution,
        else reduced (see `step_reduction.reduce_step_gradients`).
    """
    step = local_rows.running_step(model)
    if step is None:
        return gradients
    return step.reduce_gradients(gradients)


def local_metric_state(model, metric):
    """Runs a metric's update on the local values of its replicated state.

    Args:
        model: the model being trained.
        metric: a `keras.metrics.Metric` (the loss tracker).

    Returns:
        A context manager: `local_state.local_metric_state` in a step under
        a distribution, else one that does nothing.
    """
    step = local_rows.running_step(model)
    if step is None:
        return contextlib.nullcontext()
    return step.local_metric_state(metric)


def _default_train_step(model):
    """Whether `model` trains with Keras' own step: one backward pass, then
    `reduce_gradients`, which takes the overlapped buckets."""
    # The torch trainer's own step, whatever the base names its class.
    from keras.src.models.model import Model

    return type(model).train_step is Model.train_step
