"""Compiled metrics updated on each process' rows in Keras' own train and test
steps: a `Mean` of values (every built-in accuracy, error or crossentropy
metric) only adds sums over rows, so processes add their rows' sums, reduced
with the gradients (a test step's with the loss tracker's). The first step
checks this against the update through DTensor."""

import contextlib

import torch

from keras.src import tree
from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.torch.distributed.core import local_state
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core import structures
from keras.src.backend.torch.distributed.core.runtime import Partial
from keras.src.backend.torch.distributed.data_parallel import batch_coupling
from keras.src.backend.torch.distributed.data_parallel import coupled_layers
from keras.src.backend.torch.distributed.training import gradients


@contextlib.contextmanager
def compiled_metrics(rows, tracker, inputs, added=False):
    """Runs Keras' `compute_metrics` (the block) of `rows.model` (`StepRows`)
    reading `tracker` locally; with the compiled metrics' update skipped and
    read locally if `added` (by `add_with_gradients`), or checked against the
    rows' sums if not yet."""
    model = rows.model
    # Checked already where `added` (the hot path): not again.
    metrics, batch = (None, None)
    if not added:
        metrics, batch = _summing_metrics(
            model, inputs, rows.plain_batch(inputs)
        )
    check, reads = metrics and rows.metrics_on_rows is None, tracker.variables
    variables = metrics.variables if metrics else []
    if check:
        sums = gradients.reduce_parts(_row_sums(metrics, inputs, batch.mesh))
        before = local_state.replicated_locals([v.value for v in variables])
        before = [x.clone() for x in before]
    if added:
        metrics = model._compile_metrics
        metrics.update_state = lambda *args, **kwargs: None  # Made already.
        reads = list(reads) + metrics.variables
    try:
        with local_state.local_reads(reads):
            yield
    finally:
        if added:
            del metrics.update_state
    if check:  # Keras' update through DTensor, replicated on every process.
        rows.metrics_on_rows = all(
            batch_coupling.same(b + s, local_state.replicated_local(v.value))
            for v, b, s in zip(variables, before, sums)
        )


def add_with_gradients(rows, inputs, defer):
    """Whether `rows.model`'s compiled metrics' sums on the local rows of
    `inputs` were handed to `defer` (`OverlappedReduction.defer`: summed with
    the gradients' last bucket; a test step's `DeferredSums.defer`: with the
    loss tracker's; no collective of their own)."""
    batch = rows.plain_batch(inputs)
    metrics, batch = _summing_metrics(rows.model, inputs, batch)
    if not (metrics and rows.metrics_on_rows):
        return False
    n, parts = batch.mesh.size(), _row_sums(metrics, inputs, batch.mesh)
    locals_ = local_state.replicated_locals(
        [v.value for v in metrics.variables]
    )
    # Each enters as its share of the sum, as DTensor partitions it.
    return all(
        [
            defer(local, local / n + increment, batch.mesh)
            for local, (increment, _, _) in zip(locals_, parts)
        ]
    )


def _summing_metrics(model, inputs, batch=None):
    """`(model's compiled metrics, the Batch of inputs)` if Keras'
    `compute_metrics` only adds to the metrics (each a `Mean` of values),
    replicated on the batch's mesh; else `(None, None)`. `batch`: of plain
    rows (default: of DTensors)."""
    metrics = model._compile_metrics
    if metrics is None:
        return None, None
    from keras.src.metrics.reduction_metrics import Mean
    from keras.src.metrics.reduction_metrics import MeanMetricWrapper
    from keras.src.models.model import Model
    from keras.src.trainers.compile_utils import CompileMetrics

    adding = (Mean.update_state, MeanMetricWrapper.update_state)
    if (
        type(metrics) is not CompileMetrics
        or not metrics.built
        # Keras' own (the trainer's, whatever the base names its class).
        or type(model).compute_metrics is not Model.compute_metrics
        or torch.compiler.is_compiling()
        or not all(type(m).update_state in adding for m in metrics.metrics)
    ):
        return None, None
    batch = batch or coupled_layers.batch_of(inputs)
    values = [v.value for v in metrics.variables]
    # A mask on the predictions weighs the metrics (the rows' do not keep it).
    masked = any(get_keras_mask(x) is not None for x in tree.flatten(inputs[1]))
    if batch and not masked and local_state.all_replicated(values):
        if all(getattr(x, "device_mesh", None) == batch.mesh for x in values):
            return metrics, batch
    return None, None


def _row_sums(metrics, inputs, mesh):
    """What the local rows of `inputs` add to each of `metrics`' variables,
    as `reduce_parts`' parts (partial sums over `mesh`)."""
    y, y_pred, weight = structures.map_structure(
        local_state.local_value, inputs
    )
    variables = metrics.variables
    zeros = [(v, torch.zeros_like(v.value.to_local())) for v in variables]
    with (
        torch.no_grad(),
        runtime.distribution_suspended(),
        local_state.stateless_scope(zeros) as scope,
    ):
        metrics.update_state(y, y_pred, weight)
    return [(scope.get_current_value(v), mesh, (Partial(),)) for v in variables]
