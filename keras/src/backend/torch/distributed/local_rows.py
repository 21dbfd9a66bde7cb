"""Data-parallel model calls on each process' own rows, as plain tensors.

When every weight is replicated and the batch is sharded, a layer whose
call treats each sample on its own (a Dense layer, a layer normalization,
attention within a sample) computes on a process' rows exactly what DTensor
computes on them, without DTensor's dispatch on every op. A model made only
of such layers is called on the local rows as plain tensors: the weights
enter as their local values with partial-sum gradients (torch's
`local_map`), and the outputs leave as batch-sharded DTensors, so the loss,
the metrics and anything else that reduces over the batch still see the
global batch and keep one process' numbers. Any other model (batch
normalization, dropout, a subclassed `call`, an activity regularizer...)
runs through DTensor as before.
"""

from keras.src import tree
from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.common.masking import set_keras_mask
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.torch.distributed import layouts
from keras.src.backend.torch.distributed import runtime
from keras.src.backend.torch.distributed import step_reduction
from keras.src.backend.torch.distributed.runtime import DTensor

if runtime.DTENSOR_AVAILABLE:
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Shard

# Layer classes whose call treats each sample on its own (exact classes: a
# subclass may override `call`).
_PER_SAMPLE_CLASS_NAMES = (
    "keras.src.layers.core.dense.Dense",
    "keras.src.layers.core.embedding.Embedding",
    "keras.src.layers.core.einsum_dense.EinsumDense",
    "keras.src.layers.core.identity.Identity",
    "keras.src.layers.core.input_layer.InputLayer",
    "keras.src.layers.normalization.layer_normalization.LayerNormalization",
    "keras.src.layers.activations.activation.Activation",
    "keras.src.layers.activations.relu.ReLU",
    "keras.src.layers.activations.softmax.Softmax",
    "keras.src.layers.merging.add.Add",
    "keras.src.layers.pooling.global_average_pooling1d.GlobalAveragePooling1D",
    "keras.src.layers.regularization.dropout.Dropout",
    "keras.src.layers.attention.multi_head_attention.MultiHeadAttention",
    "keras.src.models.functional.Functional",
    "keras.src.models.sequential.Sequential",
)
# Where an output of a call on the local rows keeps its local tensor.
_LOCAL_OUTPUT_ATTRIBUTE = "_keras_local_output"
# Operations other than layers that a functional model may run (`x + y`).
_ELEMENTWISE_OPERATION_NAMES = (
    "keras.src.ops.numpy.Add",
    "keras.src.ops.numpy.Subtract",
    "keras.src.ops.numpy.Multiply",
)


def call(call_function, layer, args, kwargs):
    """Calls `layer` on the local rows if that gives DTensor's numbers.

    Args:
        call_function: `call_function(layer, *args, **kwargs)` calls it.
        layer: the outermost layer called (usually the model).
        args: the positional arguments, batch-sharded `DTensor`s.
        kwargs: the keyword arguments.

    Returns:
        The outputs, batch-sharded `DTensor`s; `None` where the call cannot
        be shown to be per-sample (the caller then calls it with DTensors).
    """
    sharding = _batch_sharding((args, kwargs))
    if sharding is None or not _per_sample(layer):
        return None
    mesh, global_rows, local_rows = sharding
    variables = list(layer.variables)
    if not all(_replicated_on(v.value, mesh) for v in variables):
        return None
    local_args, local_kwargs = tree.map_structure(_to_local, (args, kwargs))
    with runtime.distribution_suspended():
        with StatelessScope(
            state_mapping=[(v, _local_weight(v)) for v in variables]
        ):
            outputs = call_function(layer, *local_args, **local_kwargs)
    leaves = [x for x in tree.flatten(outputs) if x is not None]
    if not all(_is_local_batch(x, local_rows) for x in leaves):
        return None
    return tree.map_structure(
        lambda x: _to_global(x, mesh, global_rows), outputs
    )


def _batch_sharding(values):
    """`(mesh, global rows, local rows)` if every tensor in `values` is a
    DTensor sharded on its first axis over a 1-D mesh, each process holding
    at least one row; else `None`."""
    leaves = [x for x in tree.flatten(values) if hasattr(x, "shape")]
    if not leaves or not all(isinstance(x, DTensor) for x in leaves):
        return None
    mesh = leaves[0].device_mesh
    global_rows = leaves[0].shape[0] if leaves[0].ndim else 0
    for x in leaves:
        if (
            x.ndim == 0
            or x.device_mesh is not mesh
            or mesh.ndim != 1
            or tuple(x.placements) != (Shard(0),)
            or x.shape[0] != global_rows
        ):
            return None
    parts = [
        layouts.chunk_bounds(global_rows, mesh.size(), i)
        for i in range(mesh.size())
    ]
    if any(stop <= start for start, stop in parts):
        return None
    start, stop = parts[mesh.get_local_rank()]
    return mesh, global_rows, stop - start


def _per_sample(layer):
    """Whether every layer in `layer` treats each sample on its own."""
    for sublayer in layer._flatten_layers(include_self=True, recursive=True):
        if _class_name(sublayer) not in _PER_SAMPLE_CLASS_NAMES:
            return False
        # A functional graph also runs ops that are not layers (`x + y`,
        # or a mean over the batch).
        for operation in getattr(sublayer, "operations", ()):
            name = _class_name(operation)
            if (
                name not in _PER_SAMPLE_CLASS_NAMES
                and name not in _ELEMENTWISE_OPERATION_NAMES
            ):
                return False
        if not sublayer.built or sublayer.activity_regularizer is not None:
            return False
        # Dropout draws one mask over the global batch.
        if getattr(sublayer, "rate", 0) or getattr(sublayer, "_dropout", 0):
            return False
    return True


def _class_name(x):
    cls = type(x)
    return f"{cls.__module__}.{cls.__qualname__}"


def _replicated_on(value, mesh):
    return (
        isinstance(value, DTensor)
        and value.device_mesh is mesh
        and all(p.is_replicate() for p in value.placements)
    )


def _local_weight(variable):
    """A replicated weight's local value; its gradient a partial sum.

    In Keras' own train step a trainable weight enters as a plain leaf
    (see `step_reduction.local_leaf`), else through DTensor.
    """
    value = variable.value
    if not value.requires_grad:
        return value.to_local()
    leaf = step_reduction.local_leaf(variable)
    if leaf is not None:
        return leaf
    return value.to_local(grad_placements=[Partial()])


def _to_local(x):
    return x.to_local() if isinstance(x, DTensor) else x


def _is_local_batch(x, local_rows):
    """Whether `x` is a plain tensor of this process' rows (no DTensor
    took part in computing it: an op with one returns a DTensor)."""
    return (
        hasattr(x, "shape")
        and not isinstance(x, DTensor)
        and x.ndim > 0
        and x.shape[0] == local_rows
    )


def local_output(x):
    """The plain tensor of this process' rows that a batch-sharded output
    of a call on the local rows was made of (in the autograd graph of the
    call), or `None` if `x` is not such an output."""
    return getattr(x, _LOCAL_OUTPUT_ATTRIBUTE, None)


def _to_global(x, mesh, global_rows):
    """A local output as the batch-sharded global value, with its mask."""
    mask = get_keras_mask(x)
    output = _sharded(x, mesh, global_rows)
    setattr(output, _LOCAL_OUTPUT_ATTRIBUTE, x)
    if mask is not None:
        set_keras_mask(output, _sharded(mask, mesh, global_rows))
    return output


def _sharded(x, mesh, global_rows):
    x = x.contiguous()
    return layouts.dtensor_from_local(
        x, mesh, [Shard(0)], shape=(global_rows,) + tuple(x.shape[1:])
    )
