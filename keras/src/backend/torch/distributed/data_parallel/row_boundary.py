"""Keras' own train and test steps on each process' plain rows: the batch
cut to this process' rows before the step, the model called on them and its
outputs kept as they are, without the batch's and outputs' `DTensor`s. Taken
where the step before found that every reader of the batch takes local rows
(the model's call on its rows, the compiled loss as this process' term, the
compiled metrics' sums reduced with the gradients or the loss tracker's); a
reader that cannot take them in a later step gets the global batch's
`DTensor`s of them (`as_global`), and the steps after go through `DTensor`s
again."""

import contextlib

import torch

from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core import structures
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard
from keras.src.backend.torch.distributed.data_parallel import coupled_layers


def keras_own_steps(model, step_kind):
    """Whether `model` reads its batch only through Keras' own train or test
    step (`step_kind`), loss and metrics (each reading the batch through the
    step's hooks)."""
    from keras.src.models.model import Model

    kind, name = type(model), f"{step_kind}_step"
    return (
        step_kind in ("train", "test")
        and getattr(kind, name) is getattr(Model, name)
        and kind.compute_loss is Model.compute_loss
        and kind._compute_loss is Model._compute_loss
        and kind.compute_metrics is Model.compute_metrics
        and kind.__call__ is Model.__call__
        and _batch_size_free(model)
    )


def _batch_size_free(model):
    """Whether no input spec of `model` fixes the batch size (it would check
    the rows' size against the global batch's)."""
    specs = structures.flatten(getattr(model, "input_spec", None))
    return all(
        getattr(spec, "shape", None) is None or spec.shape[0] is None
        for spec in specs
    )


def plain_rows(data, distribution):
    """`(this process' rows of the global batch `data` as plain tensors, their
    `coupled_layers.Batch`)`, or `None`: under `DataParallel`, if every array
    has the same rows, as many per process (arrays cut here where the backend
    cuts the batch; `DTensor`s, which data loaders assemble, their rows)."""
    from keras.src.distribution import DataParallel

    mesh = distribution.device_mesh.backend_mesh
    if not isinstance(distribution, DataParallel) or mesh.ndim != 1:
        return None
    leaves = [x for x in structures.flatten(data) if _is_batch(x)]
    if leaves and all(isinstance(x, DTensor) for x in leaves):
        batch = coupled_layers.batch_of(leaves)
        if (
            batch is None
            or batch.mesh != mesh
            or batch.global_rows % mesh.size()
        ):
            return None
        local = structures.map_structure(
            lambda x: x.to_local() if isinstance(x, DTensor) else x, data
        )
        return local, batch
    if not leaves or not distribution.auto_shard_dataset:
        return None
    if any(isinstance(x, DTensor) for x in leaves):
        return None
    return _cut(data, leaves, mesh)


def _cut(data, leaves, mesh):
    """`plain_rows` of arrays `data` (`leaves` its arrays): each process'
    equal part, or `None`."""
    global_rows, size = int(leaves[0].shape[0]), mesh.size()
    if (
        not global_rows
        or global_rows % size
        or any(int(x.shape[0]) != global_rows for x in leaves)
    ):
        return None
    # Where `distribute_global_batch` would place this process' rows.
    start, stop = layouts.chunk_bounds(
        global_rows, size, mesh.get_coordinate()[0]
    )
    local_rows = stop - start
    placements = (Shard(0),) if size > 1 else (Replicate(),)
    batch = coupled_layers.Batch(
        mesh, global_rows, local_rows, placements, start
    )
    device = runtime.backend_core().get_device()

    def cut(x):
        if not _is_batch(x):
            return x
        return torch.as_tensor(x[start:stop], device=device)

    return structures.map_structure(cut, data), batch


def _is_batch(x):
    return hasattr(x, "shape") and len(x.shape) > 0


def as_global(values, batch):
    """`values` with each plain tensor of this process' rows of `batch` as the
    global batch's `DTensor` (its Keras mask alike)."""
    return structures.map_structure(
        lambda x: (
            coupled_layers.with_mask(coupled_layers.sharded, x, batch)
            if coupled_layers.is_rows(x, batch)
            else x
        ),
        values,
    )


@contextlib.contextmanager
def global_counts(tracker, batch):
    """Runs the loss tracker's update counting the global batch's rows: Keras'
    train step counts the rows of the batch it holds, this process'."""
    update = tracker.update_state

    def counted(values, sample_weight=None):
        if sample_weight == batch.local_rows:
            sample_weight = batch.global_rows
        return update(values, sample_weight=sample_weight)

    with _swapped(tracker, "update_state", counted):
        yield


@contextlib.contextmanager
def global_updates(metrics, batch):
    """Runs the compiled metrics' update on the global batch's `DTensor`s of
    this process' rows (a step on plain rows whose metrics cannot take them)."""
    update = metrics.update_state

    def on_global(y_true, y_pred, sample_weight=None):
        y_true, y_pred, sample_weight = as_global(
            (y_true, y_pred, sample_weight), batch
        )
        return update(y_true, y_pred, sample_weight=sample_weight)

    with _swapped(metrics, "update_state", on_global):
        yield


@contextlib.contextmanager
def _swapped(instance, name, value):
    """Sets `instance.<name>` to `value` in the block, as it was after."""
    had, previous = name in vars(instance), vars(instance).get(name)
    setattr(instance, name, value)
    try:
        yield
    finally:
        if had:
            setattr(instance, name, previous)
        else:
            delattr(instance, name)
