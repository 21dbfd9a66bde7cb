"""Weights sharded over the batch axis, gathered one layer at a time.

A `LayoutMap` that puts the batch axis on a weight dimension (keras-hub's
Llama map: query/key/value `("model", "batch", None)`) asks for what torch
calls FSDP and JAX users get from GSPMD: each process keeps a shard of the
weight, the batch stays sharded, and the weight is assembled only while it
is used. Left to DTensor, a kernel sharded on its input features is
contracted shard by shard with activations resharded to match, and every
layer output is then a partial sum reduced to a replicated value: each
process computes the whole batch, and every weight gradient is
materialized whole, replicated, until the optimizer runs (keras 8 x
Dense(4096) on 4 processes: 3.3x the ideal memory, see
`benchmarks/bench_fsdp.py`).

Here, as FSDP2's `fully_shard` does per module, a layer call gathers the
layer's own trainable weights along the batch axis first
(`gathered_weights`), so that DTensor computes the layer data-parallel on
the sharded batch:

- forward: the gathered value replaces the variable's value during the
  call. Once the call returns, the gathered storage is freed (FSDP2's
  reshard-after-forward): what autograd saved of it (the weight, or views
  of it such as an einsum's permutations) keeps its metadata, not its
  memory;
- backward: the first gradient that reaches one of the layer's outputs
  gathers the weights again, into the same storage, before the layer's
  backward ops read them; once the weight's gradient is complete, the
  storage is freed again. The gradient goes back through DTensor's
  `redistribute`, whose backward reduce-scatters the partial sums of the
  batch to the weight's own shards: a weight gradient is whole only for
  one layer at a time, and the optimizer gets it in the weight's layout.

The gathers are ordered by the layer calls and the backward pass, the same
on every process. Freeing storage that autograd saved is FSDP2's own
technique; the storage is that of the gathered copy, never the weight's.

Within a step, each layer's weights can be gathered while the layer
before it computes, as FSDP2 prefetches (see `fsdp_schedule`).

Under mixed precision (a layer computing in a narrower dtype than its
variables), a weight is cast on its shards and gathered in the compute
dtype, as FSDP2's `MixedPrecisionPolicy(param_dtype=...)` does: the
gathered copy autograd saves is then the one freed, the gather moves half
the bytes, and the gradient is reduce-scattered in the compute dtype.

`KERAS_DISTRIBUTION_GATHER_WEIGHTS` chooses the mesh axes: `"batch"` (the
default: the distribution's batch axis), `"all"` (every axis a weight is
sharded on: ZeRO-3 over the model axis too, instead of tensor parallelism)
or `"off"` (DTensor's own plan).
`KERAS_DISTRIBUTION_RESHARD_AFTER_FORWARD=0` keeps each layer's gathered
weights from its call until its backward ops have run instead of freeing
and gathering them again (FSDP2's `reshard_after_forward=False`): fewer
gathers, more memory. Compiled steps (`jit_compile=True`) run eagerly when
weights are gathered (see `compiled_step.eager_reason`).
"""

import contextlib
import os
import weakref

import torch

from keras.src import tree
from keras.src.backend.torch.distributed import fsdp_schedule
from keras.src.backend.torch.distributed import runtime
from keras.src.backend.torch.distributed.runtime import DTensor

if runtime.DTENSOR_AVAILABLE:
    from torch.distributed.tensor import Replicate

GATHER_WEIGHTS_ENV = "KERAS_DISTRIBUTION_GATHER_WEIGHTS"
_GATHER_CHOICES = ("batch", "all", "off")
RESHARD_ENV = "KERAS_DISTRIBUTION_RESHARD_AFTER_FORWARD"

# The ids of the variables whose gathered value stands for them now: a
# layer called inside its own call keeps them.
_gathered_now = set()


def gathered_mesh_dims(distribution):
    """The mesh dimensions along which weights are gathered for a call.

    Args:
        distribution: the distribution in effect.

    Returns:
        A tuple of mesh dimension indices (empty: gather nothing), or
        `None` for every dimension a weight is sharded on.
    """
    choice = os.environ.get(GATHER_WEIGHTS_ENV, "batch").lower()
    if choice not in _GATHER_CHOICES:
        raise ValueError(
            f"{GATHER_WEIGHTS_ENV} must be one of {_GATHER_CHOICES}. "
            f"Received: {GATHER_WEIGHTS_ENV}={choice!r}"
        )
    if choice == "off":
        return ()
    if choice == "all":
        return None
    batch_dim_name = getattr(distribution, "batch_dim_name", None)
    axis_names = list(distribution.device_mesh.axis_names)
    if batch_dim_name not in axis_names:
        return ()
    return (axis_names.index(batch_dim_name),)


def gathered_placements(value, mesh_dims):
    """The placements of `value` gathered along `mesh_dims`.

    Args:
        value: a variable's value.
        mesh_dims: see `gathered_mesh_dims`.

    Returns:
        The placements with `Replicate` on each of `mesh_dims` where
        `value` is sharded over more than one process, or `None` if it is
        not such a `DTensor`.
    """
    if not isinstance(value, DTensor):
        return None
    mesh = value.device_mesh
    placements = list(value.placements)
    gathered = False
    for dim, placement in enumerate(placements):
        chosen = mesh_dims is None or dim in mesh_dims
        if chosen and placement.is_shard() and mesh.size(dim) > 1:
            placements[dim] = Replicate()
            gathered = True
    return placements if gathered else None


def reshards_after_forward():
    """Whether a layer's gathered weights are freed when its call returns.

    Returns:
        `KERAS_DISTRIBUTION_RESHARD_AFTER_FORWARD` (`"1"`, the default, or
        `"0"`: kept until the layer's backward ops have run) as a `bool`.
    """
    choice = os.environ.get(RESHARD_ENV, "1")
    if choice not in ("0", "1"):
        raise ValueError(
            f"{RESHARD_ENV} must be '1' (free a layer's gathered weights "
            "after its call, gather them again for its backward) or '0' "
            f"(keep them until its backward). Received: {RESHARD_ENV}="
            f"{choice!r}"
        )
    return choice == "1"


def has_gathered_weights(model, distribution):
    """Whether some trainable weight of `model` is gathered in its calls.

    Args:
        model: a model.
        distribution: the distribution in effect.

    Returns:
        A `bool`.
    """
    mesh_dims = gathered_mesh_dims(distribution)
    if mesh_dims == ():
        return False
    return any(
        gathered_placements(v.value, mesh_dims) is not None
        for v in model.trainable_variables
    )


@contextlib.contextmanager
def gathered_weights(layer, distribution, enabled=True):
    """Gathers `layer`'s own sharded trainable weights for one call.

    Args:
        layer: the layer being called.
        distribution: the distribution in effect.
        enabled: `False` gathers nothing (a call on symbolic inputs, which
            reads no weight's values).

    Yields:
        A function of the call's outputs, to be called with them once the
        call returns: it frees the gathered storage autograd keeps and
        arranges for it to be gathered again in the backward pass. The
        gathered values stand for the weights until the context exits.
    """
    weights = _weights_to_gather(layer, distribution) if enabled else []
    if not weights:
        yield _no_outputs_to_watch
        return
    schedule = fsdp_schedule.running_schedule()
    if schedule is not None:
        schedule.take_ahead(layer, weights)
    for weight in weights:
        weight.enter()
    if schedule is not None:
        schedule.gather_ahead(
            layer, lambda following: _weights_to_gather(following, distribution)
        )
    try:
        yield lambda outputs: _release_after_forward(weights, outputs, schedule)
    finally:
        for weight in weights:
            weight.exit()


def _no_outputs_to_watch(outputs):
    return outputs


def _weights_to_gather(layer, distribution):
    variables = getattr(layer, "_trainable_variables", None)
    if not variables:
        return []
    mesh_dims = gathered_mesh_dims(distribution)
    if mesh_dims == ():
        return []
    weights = []
    for variable in variables:
        value = variable._value
        if id(variable) in _gathered_now:
            # The layer is called inside its own call (a recurrent cell):
            # its weights are gathered already.
            continue
        placements = gathered_placements(value, mesh_dims)
        if placements is not None and not value.is_meta:
            weights.append(_GatheredWeight(variable, placements))
    return weights


def _release_after_forward(weights, outputs, schedule):
    """Frees the gathered storage of `weights` once the call returned
    `outputs`, and watches the outputs' gradients to gather it again."""
    leaves = [
        x
        for x in tree.flatten(outputs)
        if isinstance(x, torch.Tensor) and not x.is_meta
    ]
    for weight in weights:
        weight.write_back()
    if not reshards_after_forward():
        return outputs
    released = [w for w in weights if w.release(leaves)]
    if released:
        restore_ahead = None
        if schedule is not None:
            restore_ahead = schedule.released(released)
        watched = [x for x in leaves if x.requires_grad]
        regather = _Regather(released, restore_ahead)
        for x in watched:
            x.register_hook(regather)
    return outputs


class _Regather:
    """A gradient hook on a layer's outputs: the first gradient that reaches
    one of them gathers the layer's weights again, before its backward ops
    read them, and starts the gather of the layer before (`restore_ahead`,
    when a step schedules the gathers)."""

    def __init__(self, weights, restore_ahead):
        self.weights = weights
        self.restore_ahead = restore_ahead

    def __call__(self, grad):
        restored = False
        for weight in self.weights:
            restored = weight.restore() or restored
        if restored and self.restore_ahead is not None:
            self.restore_ahead()
        return grad


def _completed_gradient(grad):
    """The gradient of an asynchronous gather's input, its reduce-scatter
    completed."""
    local = _local_tensor(grad)
    if local is grad.to_local():
        return grad
    return DTensor.from_local(
        local,
        grad.device_mesh,
        grad.placements,
        shape=grad.shape,
        stride=grad.stride(),
    )


def _local_tensor(value):
    """The local tensor of `value` (a tensor or `DTensor`), once computed:
    that of an asynchronous gather is a wrapper, whose `wait` returns the
    tensor."""
    local = value.to_local() if isinstance(value, DTensor) else value
    wait = getattr(local, "wait", None)
    return local if wait is None else wait()


class _GatheredWeight:
    """One trainable variable's gathered value, for one layer call.

    Args:
        variable: the variable.
        placements: its value's placements once gathered.
    """

    def __init__(self, variable, placements):
        self.variable = variable
        self.sharded = variable._value
        self.placements = placements
        # The dtype the call reads the variable in: the compute dtype of a
        # layer under mixed precision (`variable.dtype` in its autocast
        # scope), in which the shards are cast before they are gathered.
        self.dtype = getattr(torch, variable.dtype)
        self.value = None
        self.local = None
        self.storage = None
        self.nbytes = 0
        self.version = None
        # An asynchronous gather: of the value before the call
        # (`gather_ahead`, with the variable's version and the gradient
        # mode then), or of its storage's content before its backward ops
        # (`restore_ahead`).
        self.ahead = None
        self.ahead_state = None

    def _gather(self, async_op=False):
        # Differentiable: the gradient is reduce-scattered back to the
        # variable's shards.
        sharded = self.sharded
        if sharded.dtype != self.dtype:
            sharded = sharded.to(self.dtype)
        elif async_op and sharded.requires_grad and torch.is_grad_enabled():
            sharded = sharded.view_as(sharded)
        if async_op and sharded.requires_grad and torch.is_grad_enabled():
            # The backward pass of an asynchronous gather reduce-scatters
            # asynchronously too, and the collective holds its whole input
            # until it is waited for: the optimizer would find every
            # layer's whole gradient alive.
            sharded.register_hook(_completed_gradient)
        return sharded.redistribute(
            sharded.device_mesh, self.placements, async_op=async_op
        )

    def gather_ahead(self):
        """Starts gathering the value, for a call to come."""
        self.ahead = self._gather(async_op=True)
        self.ahead_state = (self.sharded._version, torch.is_grad_enabled())

    def take(self, other):
        """Takes the value `other` gathered ahead for this call, if it is
        what this call would gather; else drops it."""
        if other is None:
            return
        if (
            other.placements == self.placements
            and other.dtype == self.dtype
            and other.ahead_state
            == (self.sharded._version, torch.is_grad_enabled())
        ):
            self.ahead, other.ahead = other.ahead, None
        else:
            other.drop_ahead()

    def drop_ahead(self):
        """Waits for a gather started ahead and forgets it."""
        if self.ahead is not None:
            _local_tensor(self.ahead)
            self.ahead = None

    def enter(self):
        """Gathers the value and lets it stand for the variable."""
        self.value = self.ahead if self.ahead is not None else self._gather()
        self.ahead = None
        self.version = self.value._version
        self.variable._value = self.value
        _gathered_now.add(id(self.variable))

    def exit(self):
        """Gives the variable its sharded value back."""
        self.variable._value = self.sharded
        _gathered_now.discard(id(self.variable))

    def write_back(self):
        """Keeps what the call assigned to the variable
        (`SpectralNormalization` assigns its kernel), in its shards.

        Not from a copy in the compute dtype: Keras assigns such a copy
        without effect on the variable."""
        if self.value._version == self.version:
            return
        if self.dtype == self.sharded.dtype:
            with torch.no_grad():
                self.sharded.copy_(
                    self.value.redistribute(
                        self.sharded.device_mesh, self.sharded.placements
                    )
                )
        self.version = self.value._version

    def release(self, outputs):
        """Frees the gathered storage after the forward pass.

        Args:
            outputs: the call's output tensors.

        Returns:
            Whether the storage was freed: not when no gradient will flow
            to it (autograd keeps nothing of it, which goes when the call
            ends), nor when an output or the weight's own value shares it.
        """
        value = self.value
        if not (value.requires_grad and torch.is_grad_enabled()):
            return False
        with torch.no_grad():
            local = _local_tensor(value)
        storage = local.untyped_storage()
        shared = [self.sharded.to_local()] + [_local_tensor(x) for x in outputs]
        if any(
            x.untyped_storage().data_ptr() == storage.data_ptr() for x in shared
        ):
            return False
        self.storage = storage
        self.nbytes = storage.nbytes()
        storage.resize_(0)
        # Once the weight's gradient is complete, every backward op that
        # read the gathered value has run.
        value.register_hook(self._release_after_backward)
        # Held weakly from now on: if autograd saved neither the value nor
        # a view of its local tensor (a view holds its base: an op computed
        # on the local tensors, such as `local_einsum`, saves no `DTensor`),
        # the local tensor is gone once the call returns (the first layer's
        # kernel, whose input needs no gradient), and the backward pass need
        # not gather it again.
        self.value = None
        self.local = weakref.ref(local)
        return True

    def needs_restore(self):
        """Whether the backward pass has yet to gather the value again."""
        return (
            self.storage is not None
            and self.storage.nbytes() != self.nbytes
            and self.ahead is None
            and self.local() is not None
        )

    def restore_ahead(self):
        """Starts gathering the value again, for its backward ops."""
        with torch.no_grad():
            self.ahead = self._gather(async_op=True)

    def restore(self):
        """Gathers the value again into its storage, if it was freed and
        autograd still holds it.

        Returns:
            Whether it was gathered now.
        """
        if self.storage is None or self.storage.nbytes() == self.nbytes:
            return False
        local = self.local()
        if local is None:
            self.drop_ahead()
            return False
        with torch.no_grad():
            fresh = self.ahead
            if fresh is None:
                fresh = self._gather()
            self.ahead = None
            fresh = _local_tensor(fresh)
            self.storage.resize_(self.nbytes)
            # Written through a tensor of its own on the storage: written
            # through the local tensor, the version counter that its views
            # share would change, and autograd would refuse the views it
            # saved (`to_local()` returns a view).
            target = torch.empty(0, dtype=local.dtype, device=local.device)
            target.set_(
                self.storage,
                local.storage_offset(),
                local.shape,
                local.stride(),
            )
            target.copy_(fresh)
        return True

    def _release_after_backward(self, grad):
        if self.storage is not None:
            self.storage.resize_(0)
        return grad
