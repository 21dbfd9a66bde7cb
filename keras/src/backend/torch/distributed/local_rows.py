"""Data-parallel model calls on each process' own rows, as plain tensors.

When every weight is replicated and the batch is sharded, a call that
treats each sample on its own computes on a process' rows exactly what
DTensor computes on them, without DTensor's dispatch on every op. Which
calls do is measured on the first one (`batch_coupling`'s probe: DTensor's
own collectives, then the same call on the local rows compared), whatever
the classes of the layers. A per-sample model is then called on the local
rows as plain tensors: the weights enter as their local values with
partial-sum gradients (torch's `local_map`), and the outputs leave as
batch-sharded DTensors, so the loss, the metrics and anything else that
reduces over the batch still see the global batch and keep one process'
numbers.

What couples the samples of a batch inside the model is made global by
one mechanism each:

- moments over the batch axis (`BatchNormalization` in training) are
  computed from sums all-reduced across processes
  (`batch_statistics.batch_moments`), as torch's `SyncBatchNorm` does; the
  moving statistics a layer updates are written back to its variables;
- a model whose call draws random numbers (it advances a layer's
  `SeedGenerator`: dropout, noise, augmentation), assigns a trainable
  variable (`SpectralNormalization`), adds a loss (an activity
  regularizer's, taken over the global batch), reduces over the batch, or
  computes anything else on its local rows than on the global batch, runs
  through DTensor (in that step function: its train step draws, its test
  step, in inference, may not; the step remembers).
"""

import contextlib
import random
import threading
import weakref

import numpy as np
import torch

from keras.src import tree
from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.common.masking import set_keras_mask
from keras.src.backend.torch.distributed import batch_coupling
from keras.src.backend.torch.distributed import fallback
from keras.src.backend.torch.distributed import layouts
from keras.src.backend.torch.distributed import local_state
from keras.src.backend.torch.distributed import runtime
from keras.src.backend.torch.distributed.runtime import DTensor

if runtime.DTENSOR_AVAILABLE:
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard

# The attribute of a model on which its step function sets the running
# `step.DistributedStep` (see `running_step`).
STEP_ATTRIBUTE = "_distributed_step"
# The local call running in this thread: `(process group, global rows)`,
# for `batch_moments`, which the call reaches through the backend's
# `moments` with no model or step at hand. A call's context, not a step's:
# a call runs in the thread that makes it (its backward pass, which may run
# elsewhere, reads nothing here).
_local_call = threading.local()
# What the probe found of calls outside a step: `{layer: {training:
# batch_coupling.Verdict}}` (a step keeps its own, `step.verdicts`).
_verdicts = weakref.WeakKeyDictionary()


def running_step(model):
    """The `step.DistributedStep` running a step of `model` now, or `None`.

    Args:
        model: a layer (the outermost layer of a call).

    Returns:
        The step its step function set on it, while that function runs.
    """
    return getattr(model, STEP_ATTRIBUTE, None)


def call(call_function, layer, args, kwargs, through_dtensor):
    """Calls `layer` on the local rows if that gives DTensor's numbers.

    Args:
        call_function: `call_function(layer, *args, **kwargs)` calls it.
        layer: the outermost layer called (usually the model).
        args: the positional arguments, batch-sharded `DTensor`s.
        kwargs: the keyword arguments.
        through_dtensor: `through_dtensor(args, kwargs)` calls it on
            `DTensor`s: the probe's first call.

    Returns:
        The outputs, batch-sharded `DTensor`s; `None` where the call is not
        per-sample (the caller then calls it with DTensors). Within a step
        of `layer` (see `running_step`), the step keeps each output's local
        tensor, and learns whether the call must run through DTensor.
    """
    step = running_step(layer)
    sharding = _batch_sharding((args, kwargs))
    if sharding is None or (step is not None and step.runs_through_dtensor):
        return None
    mesh = sharding[0]
    # A step decides once, for its step function (`step.local_variables`).
    if step is not None:
        variables = step.local_variables(mesh)
    else:
        variables = local_variables(layer, mesh)
    if variables is None:
        return None
    # A step keeps the verdicts on its model's calls; calls outside a step
    # are remembered per layer.
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
    return _call_locally(call_function, layer, args, kwargs, variables, step)


def verdict(layer, training=False):
    """What the probe found of `layer`'s calls outside a step, or `None`.

    Args:
        layer: the outermost layer of a call (usually a model).
        training: the call's `training` argument.

    Returns:
        A `batch_coupling.Verdict`, or `None` before a probe.
    """
    return _verdicts.get(layer, {}).get(bool(training))


def _probe(call_function, layer, args, kwargs, through_dtensor, variables):
    """Calls `layer` through DTensor, then checks its call on local rows.

    Returns:
        `(outputs of the DTensor call, batch_coupling.Verdict)`; no verdict
        (`None`) if the call built a layer (its variables are not all known
        yet: the next call probes again).
    """
    mesh, global_rows, local_rows, placements = _batch_sharding((args, kwargs))
    watch = batch_coupling.PartialWatch()
    # The fallback's modes first: within a step they stay on to its end
    # (its backward pass), past the watch.
    with fallback.dtensor_fallback(), watch:
        outputs = through_dtensor(args, kwargs)
    if len(layer.variables) != len(variables):
        return outputs, None
    rows = [
        _own_rows(x, mesh, global_rows, placements)
        for x in tree.flatten(outputs)
        if x is not None
    ]
    split = all(x is not None for x in rows)
    local_leaves, reason = None, None
    if split and not watch.reductions:
        local_leaves, reason = _checking_call(
            call_function, layer, args, kwargs, variables, local_rows
        )
    return outputs, batch_coupling.verdict_of(
        watch, rows if split else None, local_leaves, reason
    )


def _own_rows(x, mesh, global_rows, placements):
    """This process' rows of a probe's output, or `None` if it has none.

    An output split as the inputs are is its local tensor; one left whole
    (an op DTensor refused, computed on global values) is cut.
    """
    if not (
        isinstance(x, DTensor)
        and x.device_mesh is mesh
        and x.ndim > 0
        and x.shape[0] == global_rows
    ):
        return None
    if tuple(x.placements) == placements:
        return x.to_local()
    if all(p.is_replicate() for p in x.placements):
        start, stop = layouts.chunk_bounds(
            global_rows, mesh.size(), mesh.get_local_rank()
        )
        return x.to_local()[start:stop]
    return None


def _checking_call(call_function, layer, args, kwargs, variables, rows):
    """The probe's call on the local rows: no gradient, nothing kept.

    Returns:
        `(output leaves, None)`, or `(None, why the call is not
        per-sample)`.
    """
    mesh, global_rows = _batch_sharding((args, kwargs))[:2]
    local_args, local_kwargs = tree.map_structure(_to_local, (args, kwargs))
    mapping = [(v, v.value.to_local()) for v in variables]
    rng_states = _rng_states()
    with torch.no_grad(), runtime.distribution_suspended():
        with _in_local_call(mesh, global_rows):
            with local_state.stateless_scope(mapping, True) as scope:
                entered = dict(scope.state_mapping)
                outputs = call_function(layer, *local_args, **local_kwargs)
    updated = [
        v for v in variables if scope.get_current_value(v) is not entered[id(v)]
    ]
    drew = _drew_random_numbers(layer, updated) or _rng_advanced(rng_states)
    _restore_rng_states(rng_states)
    if drew:
        return None, "draws random numbers"
    if any(v.trainable for v in updated):
        return None, "assigns a trainable variable"
    if scope.losses:
        return None, "adds a loss (taken over the global batch)"
    leaves = [x for x in tree.flatten(outputs) if x is not None]
    if not all(_is_local_batch(x, rows) for x in leaves):
        return None, "its outputs on the local rows are not plain rows"
    return leaves, None


def _call_locally(call_function, layer, args, kwargs, variables, step):
    """Calls `layer` on the local rows; `None` if the call must run
    through DTensor after all (then nothing it did is kept)."""
    mesh, global_rows, local_rows, placements = _batch_sharding((args, kwargs))
    local_args, local_kwargs = tree.map_structure(_to_local, (args, kwargs))
    mapping = [(v, _local_weight(v, step)) for v in variables]
    # Unseeded random ops draw from torch's generators: a call dropped
    # below must leave them as it found them.
    rng_states = _rng_states()
    with runtime.distribution_suspended(), _in_local_call(mesh, global_rows):
        with local_state.stateless_scope(mapping, True) as scope:
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
        or scope.losses
    ):
        # What the probe did not see in its call (a call that draws, or
        # adds a loss, only now and then): the call runs again through
        # DTensor, this time and from now on in this step function.
        # Nothing the call updated is kept.
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
        The list of the model's variables if every one is replicated on
        `mesh`, else `None`. Whether its calls are per-sample is the
        probe's (see `call`).
    """
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
