"""Data-parallel model calls on each process' own rows, as plain tensors.

When every weight is replicated and the batch is sharded, a layer whose
call treats each sample on its own (a Dense or convolution layer, pooling,
a recurrent layer, attention within a sample) computes on a process' rows
exactly what DTensor computes on them, without DTensor's dispatch on every
op. A model made only of Keras' own layers is called on the local rows as
plain tensors: the weights enter as their local values with partial-sum
gradients (torch's `local_map`), and the outputs leave as batch-sharded
DTensors, so the loss, the metrics and anything else that reduces over the
batch still see the global batch and keep one process' numbers.

What couples the samples of a batch inside the model is made global by
one mechanism each:

- moments over the batch axis (`BatchNormalization` in training) are
  computed from sums all-reduced across processes
  (`batch_statistics.batch_moments`), as
  torch's `SyncBatchNorm` does; the moving statistics a layer updates are
  written back to its variables;
- a model whose call draws random numbers (it advances a layer's
  `SeedGenerator`: dropout, noise, augmentation) runs through DTensor from
  its first such call on, which draws one process' numbers for the
  global batch (in that step function: its train step draws, its test
  step, in inference, may not; the step remembers); so does a model whose
  call assigns a trainable variable (`SpectralNormalization`), a model
  with a layer that adds an activity regularization loss (taken over the
  global batch), or runs code the project cannot classify (a `Lambda`, a
  wrapped torch module, a class defined outside Keras).
"""

import contextlib
import random
import threading

import numpy as np
import torch

from keras.src import tree
from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.common.masking import set_keras_mask
from keras.src.backend.torch.distributed import layouts
from keras.src.backend.torch.distributed import local_state
from keras.src.backend.torch.distributed import runtime
from keras.src.backend.torch.distributed.runtime import DTensor

if runtime.DTENSOR_AVAILABLE:
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard

# Layers of Keras' own that run code of the user's.
_USER_CODE_CLASS_NAMES = (
    "keras.src.layers.core.lambda_layer.Lambda",
    "keras.src.utils.torch_utils.TorchModuleWrapper",
)
# The attribute of a model on which its step function sets the running
# `step.DistributedStep` (see `running_step`).
STEP_ATTRIBUTE = "_distributed_step"
# Operations other than layers that a functional model may run (`x + y`).
_ELEMENTWISE_OPERATION_NAMES = (
    "keras.src.ops.numpy.Add",
    "keras.src.ops.numpy.Subtract",
    "keras.src.ops.numpy.Multiply",
    "keras.src.ops.numpy.Divide",
    "keras.src.ops.numpy.TrueDivide",
    "keras.src.ops.numpy.Maximum",
    "keras.src.ops.numpy.Minimum",
    "keras.src.ops.numpy.Negative",
    "keras.src.ops.numpy.Absolute",
    "keras.src.ops.numpy.Square",
    "keras.src.ops.numpy.Exp",
    "keras.src.ops.numpy.Tanh",
    "keras.src.ops.numpy.NotEqual",
    "keras.src.ops.numpy.Equal",
    "keras.src.ops.numpy.Greater",
    "keras.src.ops.numpy.Less",
    "keras.src.ops.numpy.LogicalAnd",
    "keras.src.ops.numpy.LogicalOr",
    "keras.src.ops.numpy.LogicalNot",
)
# The local call running in this thread: `(process group, global rows)`,
# for `batch_moments`, which the call reaches through the backend's
# `moments` with no model or step at hand. A call's context, not a step's:
# a call runs in the thread that makes it (its backward pass, which may run
# elsewhere, reads nothing here).
_local_call = threading.local()


def running_step(model):
    """The `step.DistributedStep` running a step of `model` now, or `None`.

    Args:
        model: a layer (the outermost layer of a call).

    Returns:
        The step its step function set on it, while that function runs.
    """
    return getattr(model, STEP_ATTRIBUTE, None)


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
        Within a step of `layer` (see `running_step`), the step keeps each
        output's local tensor, and learns whether the call must run
        through DTensor.
    """
    step = running_step(layer)
    sharding = _batch_sharding((args, kwargs))
    if sharding is None or (step is not None and step.runs_through_dtensor):
        return None
    mesh, global_rows, local_rows, placements = sharding
    # A step decides once, for its step function (`step.local_variables`).
    if step is not None:
        variables = step.local_variables(mesh)
    else:
        variables = local_variables(layer, mesh)
    if variables is None:
        return None
    local_args, local_kwargs = tree.map_structure(_to_local, (args, kwargs))
    mapping = [(v, _local_weight(v, step)) for v in variables]
    # Unseeded random ops draw from torch's generators: a call dropped
    # below must leave them as it found them.
    rng_states = _rng_states()
    with runtime.distribution_suspended(), _in_local_call(mesh, global_rows):
        with local_state.stateless_scope(mapping) as scope:
            entered = dict(scope.state_mapping)
            outputs = call_function(layer, *local_args, **local_kwargs)
    leaves = [x for x in tree.flatten(outputs) if x is not None]
    if not all(_is_local_batch(x, local_rows) for x in leaves):
        _restore_rng_states(rng_states)
        return None
    updated = [
        (v, scope.get_current_value(v))
        for v in variables
        if scope.get_current_value(v) is not entered[id(v)]
    ]
    updated_variables = [v for v, _ in updated]
    if (
        _drew_random_numbers(layer, updated_variables)
        or _rng_advanced(rng_states)
        or any(v.trainable for v in updated_variables)
    ):
        # Random numbers drawn for the local rows, not as one process
        # draws them for the global batch; or a trainable variable
        # assigned in the call (`SpectralNormalization` writes its
        # normalized kernel, which one process then differentiates as a
        # leaf): the call runs again through DTensor, this time and from
        # now on in this step function. Nothing the call updated is kept.
        if step is not None:
            step.runs_through_dtensor = True
        _restore_rng_states(rng_states)
        return None
    with torch.no_grad():
        for variable, value in updated:
            # Moving statistics: the same on every process (global
            # moments), written into the replicated local values.
            variable.value.to_local().copy_(value)

    def to_global(x):
        output = _to_global(x, mesh, global_rows, placements)
        if step is not None:
            step.keep_local_output(output, x)
        return output

    return tree.map_structure(to_global, outputs)


@contextlib.contextmanager
def _in_local_call(mesh, global_rows):
    _local_call.current = (mesh.get_group(), global_rows)
    try:
        yield
    finally:
        _local_call.current = None


def local_call_group():
    """The process group of the call on the local rows this thread runs
    (its mesh's), or `None` outside such a call."""
    current = getattr(_local_call, "current", None)
    return None if current is None else current[0]


def local_variables(model, mesh):
    """The variables of `model` if it may be called on the local rows.

    Args:
        model: the outermost layer of a call.
        mesh: the (1-D) mesh its batch is sharded over.

    Returns:
        The list of the model's variables if every layer in it is one of
        Keras' own per-sample layers (see `_per_sample`) and every variable
        is replicated on `mesh`, else `None`.
    """
    if not _per_sample(model):
        return None
    variables = list(model.variables)
    if not all(_replicated_on(v.value, mesh) for v in variables):
        return None
    return variables


def classification_final(model):
    """Whether what `local_variables` says of `model` holds from now on.

    Once every layer in the model is built, its layers, their variables and
    the variables' layouts no longer change (assignments keep a variable's
    layout): a step function may keep the answer (Keras' own compiled
    steps, JAX's too, also see the model as it was when first traced).
    Before, a layer still to be built answers `False` for now.
    """
    return all(
        sublayer.built
        for sublayer in model._flatten_layers(include_self=True, recursive=True)
    )


def _batch_sharding(values):
    """`(mesh, global rows, local rows, placements)` if every tensor in
    `values` is a DTensor sharded on its first axis over a 1-D mesh, each
    process holding at least one row; else `None`.

    On a mesh of one process, inputs left whole (`Replicate`, as
    `distribute_tensor` leaves a batch on an axis of size one) are that
    process' rows too: a `DataParallel` job of one process computes on
    plain tensors, as one with several does.
    """
    leaves = [x for x in tree.flatten(values) if hasattr(x, "shape")]
    if not leaves or not all(isinstance(x, DTensor) for x in leaves):
        return None
    mesh = leaves[0].device_mesh
    global_rows = leaves[0].shape[0] if leaves[0].ndim else 0
    placements = tuple(leaves[0].placements)
    if mesh.ndim != 1 or placements not in _batch_placements(mesh):
        return None
    for x in leaves:
        if (
            x.ndim == 0
            or x.device_mesh is not mesh
            or tuple(x.placements) != placements
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
    return mesh, global_rows, stop - start, placements


def _batch_placements(mesh):
    """The placements of a batch split over the 1-D `mesh`."""
    if mesh.size() == 1:
        return ((Shard(0),), (Replicate(),))
    return ((Shard(0),),)


def _per_sample(layer):
    """Whether every layer in `layer` treats each sample on its own, or
    couples samples only through moments over the batch axis."""
    # Imported here: the layers import the backend, which imports this.
    from keras.src.layers import BatchNormalization
    from keras.src.layers import Layer

    sublayers = list(layer._flatten_layers(include_self=True, recursive=True))
    for sublayer in sublayers:
        if not _keras_own(sublayer) or not sublayer.built:
            return False
        # Their losses are taken over the global batch.
        if sublayer.activity_regularizer is not None:
            return False
        # A functional graph also runs ops that are not layers (`x + y`,
        # or a mean over the batch).
        for operation in getattr(sublayer, "operations", ()):
            if not isinstance(operation, Layer) and (
                _class_name(operation) not in _ELEMENTWISE_OPERATION_NAMES
            ):
                return False
    # Batch normalization's masked moments are sums over the local rows.
    return not any(
        isinstance(x, BatchNormalization) and _gets_a_mask(x) for x in sublayers
    )


def _gets_a_mask(layer):
    """Whether a mask reaches `layer` in a functional graph (a mask made
    upstream, e.g. by `Masking` or `Embedding(mask_zero=True)`)."""
    return any(
        get_keras_mask(x) is not None
        for node in layer._inbound_nodes
        for x in node.input_tensors
    )


def _rng_states():
    """The global generators a layer may draw from without a seed generator.

    Besides torch's, Python's `random` (`AugMix` picks its operations with
    it) and NumPy's global generator.
    """
    states = {
        "cpu": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _rng_advanced(states):
    """Whether an unseeded random op drew from a global generator."""
    if not torch.equal(states["cpu"], torch.get_rng_state()):
        return True
    if states["python"] != random.getstate():
        return True
    if not _same_numpy_state(states["numpy"], np.random.get_state(False)):
        return True
    return "cuda" in states and any(
        not torch.equal(a, b)
        for a, b in zip(states["cuda"], torch.cuda.get_rng_state_all())
    )


def _same_numpy_state(a, b):
    # The Mersenne Twister state holds an array: `==` on it is ambiguous.
    return (
        a["state"]["pos"] == b["state"]["pos"]
        and a["has_gauss"] == b["has_gauss"]
        and a["gauss"] == b["gauss"]
        and np.array_equal(a["state"]["key"], b["state"]["key"])
    )


def _restore_rng_states(states):
    torch.set_rng_state(states["cpu"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


def _drew_random_numbers(layer, updated_variables):
    """Whether a call of `layer` advanced one of its seed generators."""
    states = {
        id(generator.state)
        for sublayer in layer._flatten_layers(include_self=True)
        for generator in sublayer._seed_generators
    }
    return any(id(v) in states for v in updated_variables)


def _keras_own(layer):
    """Whether `layer`'s class, and all the code its call runs, is Keras'."""
    module = type(layer).__module__
    return (
        module.startswith("keras.src.")
        and _class_name(layer) not in _USER_CODE_CLASS_NAMES
    )


def _class_name(x):
    cls = type(x)
    return f"{cls.__module__}.{cls.__qualname__}"


def _replicated_on(value, mesh):
    return (
        isinstance(value, DTensor)
        and value.device_mesh is mesh
        and all(p.is_replicate() for p in value.placements)
    )


def _local_weight(variable, step):
    """A replicated weight's local value; its gradient a partial sum.

    In Keras' own train step a trainable weight enters as a plain leaf
    (see `step_reduction.OverlappedReduction.local_leaf`), else through
    DTensor.
    """
    value = variable.value
    if not value.requires_grad:
        return value.to_local()
    leaf = None if step is None else step.local_leaf(variable)
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


def _to_global(x, mesh, global_rows, placements):
    """A local output as the global value laid out as the inputs were
    (`placements`), with its mask."""
    mask = get_keras_mask(x)
    output = _sharded(x, mesh, global_rows, placements)
    if mask is not None:
        set_keras_mask(output, _sharded(mask, mesh, global_rows, placements))
    return output


def _sharded(x, mesh, global_rows, placements):
    x = x.contiguous()
    return layouts.dtensor_from_local(
        x, mesh, list(placements), shape=(global_rows,) + tuple(x.shape[1:])
    )
