"""A per-sample compiled loss on plain tensors: each process' weighted sum of
its rows' values over the global count, a partial sum (replicated: whole)."""

import functools

import torch

from keras.src import tree
from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Partial
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard

# Built-in losses taking a softmax of logits: DTensor gathers a class axis.
_SOFTMAX_FUNCTION_NAMES = frozenset(
    "categorical_crossentropy categorical_focal_crossentropy "
    "sparse_categorical_crossentropy".split()
)
# Built-in losses reducing each sample over its own (last) axes only.
_PER_SAMPLE_FUNCTION_NAMES = _SOFTMAX_FUNCTION_NAMES | frozenset(
    "binary_crossentropy binary_focal_crossentropy categorical_hinge hinge "
    "cosine_similarity huber kl_divergence log_cosh mean_absolute_error "
    "mean_absolute_percentage_error mean_squared_error poisson squared_hinge "
    "mean_squared_logarithmic_error".split()
)


def gathered_predictions(model, y, y_pred):
    """`y_pred`, its class axis gathered for one compiled softmax cross-entropy
    of logits: one gather serves the loss (on plain tensors) and `argmax`."""
    if not isinstance(y_pred, DTensor) or y_pred.ndim == 0:
        return y_pred
    placements = [
        Replicate() if p.is_shard() and p.dim in (y_pred.ndim - 1, -1) else p
        for p in y_pred.placements
    ]
    if (
        placements == list(y_pred.placements)
        or (entry := _single_compiled_loss(model, y, y_pred)) is None
        or entry.loss.fn.__name__ not in _SOFTMAX_FUNCTION_NAMES
        or not entry.loss._fn_kwargs.get("from_logits", False)
    ):
        return y_pred
    return y_pred.redistribute(y_pred.device_mesh, placements)


def local_compiled_loss(
    model, y, y_pred, sample_weight, local_y_pred, local_weight
):
    """The step's loss from local tensors as `(local tensor, placements)`: a
    partial sum if `y_pred`'s rows are a local-rows call's, else replicated;
    `None` if it may differ. `local_weight(v)`: a weight's local value."""
    entry = _single_compiled_loss(model, y, y_pred)
    if entry is None or y is None or get_keras_mask(y_pred) is not None:
        return None
    local_y_pred, placements = _local_prediction(
        y_pred, local_y_pred, [y, sample_weight]
    )
    if local_y_pred is None:
        return None
    weight = None if sample_weight is None else sample_weight.to_local()
    share = _share(
        model,
        entry,
        (y.to_local(), local_y_pred, weight),
        (y_pred.shape[0], y_pred.device_mesh, placements),
        local_weight,
    )
    return None if share is None else (share, placements)


def rows_compiled_loss(model, y, y_pred, sample_weight, batch, local_weight):
    """The step's loss as this process' plain term of the sum over `batch`
    (`coupled_layers.Batch`), from its plain rows, or `None` if it may
    differ. `local_weight(v)`: a weight's local value."""
    entry = _single_compiled_loss(model, y, y_pred)
    given = [x for x in (y, y_pred, sample_weight) if x is not None]
    if (
        entry is None
        or y is None
        or get_keras_mask(y_pred) is not None
        or any(isinstance(x, DTensor) for x in given)
        or any(x.shape[:1] != (batch.local_rows,) for x in given)
    ):
        return None
    where = (batch.global_rows, batch.mesh, [Partial()])
    return _share(model, entry, (y, y_pred, sample_weight), where, local_weight)


def _share(model, entry, rows, where, local_weight):
    """The loss of `entry` (plus the model's other losses) on local `rows`,
    `(y, y_pred, sample_weight)`, `where` `(global rows, mesh, placements)`
    says how processes' values make the loss; `None` if it may differ."""
    from keras.src import ops

    global_rows, mesh, placements = where
    others = _other_losses(model, mesh, placements, local_weight)
    if others is None:
        return None
    with runtime.distribution_suspended():
        share = _loss_share(entry.loss, *rows, global_rows)
        if share is None:
            return None
        share = ops.cast(share, model._compile_loss.dtype)
        if entry.loss_weights is not None:
            share = ops.multiply(share, entry.loss_weights)
        if others:
            parts = [
                ops.multiply(model._aggregate_additional_loss(value()), scale)
                for value, scale in others
            ]
            share = ops.add(share, ops.sum(parts))
    return share


def _other_losses(model, mesh, placements, local_weight):
    """Other losses as `(local value fn, scale)`, or `None`: a partial sum's
    part counted on each process, a whole one on the first only."""
    if model._losses_override:
        return None
    layers = model._flatten_layers(include_self=True)
    added = [x for layer in layers for x in layer._get_own_losses()]
    weights = model.trainable_weights
    regularized = [v for v in weights if v.regularizer is not None]
    if not added and not regularized:
        return []
    if placements != [Partial()] or torch.compiler.is_compiling():
        return None
    first = 1.0 if mesh.get_local_rank() == 0 else 0.0
    others = []
    for x in added:
        # A coupled layer's: whole, counted once (its gradient a partial
        # sum), or each process' part of a partial sum (the whole gradient).
        if not (isinstance(x, DTensor) and x.device_mesh == mesh):
            return None
        is_part = x.placements == (Partial(),)
        if not is_part and x.placements != (Replicate(),):
            return None
        grad = [Replicate()] if is_part else [Partial()]
        local = functools.partial(x.to_local, grad_placements=grad)
        others.append((local, 1.0 if is_part else first))
    return others + [
        (functools.partial(v.regularizer, local_weight(v)), first)
        for v in regularized
    ]


def _local_prediction(y_pred, local_y_pred, values):
    """`(local y_pred, loss placements)`, or `(None, None)`: `values` (or
    `None`) batch-sharded as `y_pred`, or all replicated on its mesh."""
    given = [x for x in [y_pred, *values] if x is not None]
    if not all(
        isinstance(x, DTensor) and x.device_mesh == y_pred.device_mesh
        for x in given
    ):
        return None, None
    replicated = all(p.is_replicate() for x in given for p in x.placements)
    sharded = all(
        tuple(x.placements) == (Shard(0),) and x.shape[0] == y_pred.shape[0]
        for x in given[1:]
    )
    # One process' rows are the whole batch: a sum of one part.
    one = replicated and y_pred.device_mesh.size() == 1
    if local_y_pred is not None and (sharded or one):
        return local_y_pred, [Partial()]
    if replicated:
        # Every process' gradient of the loss is the whole gradient.
        placements = [Replicate()] * y_pred.device_mesh.ndim
        return y_pred.to_local(grad_placements=placements), placements
    return None, None


def _single_compiled_loss(model, y, y_pred):
    """The compiled loss' one entry, if Keras' own `compute_loss` uses it."""
    from keras.src.models.model import Model
    from keras.src.trainers.compile_utils import CompileLoss

    compile_loss = getattr(model, "_compile_loss", None)
    if (
        type(compile_loss) is not CompileLoss
        or not compile_loss.built
        # Keras' own (the trainer's, whatever the base names its class).
        or type(model).compute_loss is not Model.compute_loss
        or type(model)._compute_loss is not Model._compute_loss
        or tree.is_nested(y)
        or tree.is_nested(y_pred)
        or len(compile_loss._flat_losses) != 1
    ):
        return None
    entry = compile_loss._flat_losses[0]
    return None if entry.path or not _per_sample_loss(entry.loss) else entry


def _per_sample_loss(loss):
    """Whether `loss` is a built-in per-sample loss, summed over the batch."""
    from keras.src.losses.loss import Loss
    from keras.src.losses.losses import LossFunctionWrapper

    fn = getattr(loss, "fn", None)
    return (
        isinstance(loss, LossFunctionWrapper)
        and type(loss).call is LossFunctionWrapper.call
        and type(loss).__call__ is Loss.__call__
        and loss.reduction == "sum_over_batch_size"
        and getattr(fn, "__module__", None) == "keras.src.losses.losses"
        and getattr(fn, "__name__", None) in _PER_SAMPLE_FUNCTION_NAMES
        and loss._fn_kwargs.get("axis", -1) == -1
    )


def _loss_share(loss, y_true, y_pred, sample_weight, global_rows):
    """This process' share of per-sample `loss` on the batch, or `None`."""
    from keras.src import ops
    from keras.src.losses.loss import reduce_weighted_values

    y_true = ops.convert_to_tensor(y_true, dtype=loss.dtype)
    y_pred = ops.convert_to_tensor(y_pred, dtype=loss.dtype)
    values = loss.call(y_true, y_pred)
    if (
        get_keras_mask(values) is not None
        or values.shape[:1] != y_pred.shape[:1]
    ):
        return None
    weighted_sum = reduce_weighted_values(
        values, sample_weight=sample_weight, reduction="sum", dtype=loss.dtype
    )
    return weighted_sum / (values.numel() // values.shape[0] * global_rows)
