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

`KERAS_DISTRIBUTION_GATHER_WEIGHTS` chooses the mesh axes: `"batch"` (the
default: the distribution's batch axis), `"all"` (every axis a weight is
sharded on: ZeRO-3 over the model axis too, instead of tensor parallelism)
or `"off"` (DTensor's own plan). Compiled steps (`jit_compile=True`) run
eagerly when weights are gathered (see `compiled_step.eager_reason`).
"""

import contextlib
import os
import weakref

import torch

from keras.src import tree
from keras.src.backend.torch.distributed import runtime
from keras.src.backend.torch.distributed.runtime import DTensor

if runtime.DTENSOR_AVAILABLE:
    from torch.distributed.tensor import Replicate

GATHER_WEIGHTS_ENV = "KERAS_DISTRIBUTION_GATHER_WEIGHTS"
_GATHER_CHOICES = ("batch", "all", "off")

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
    for weight in weights:
        weight.enter()
    try:
        yield lambda outputs: _release_after_forward(weights, outputs)
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


def _release_after_forward(weights, outputs):
    """Frees the gathered storage of `weights` once the call returned
    `outputs`, and watches the outputs' gradients to gather it again."""
    leaves = [
        x
        for x in tree.flatten(outputs)
        if isinstance(x, torch.Tensor) and not x.is_meta
    ]
    for weight in weights:
        weight.write_back()
    released = [w for w in weights if w.release(leaves)]
    if released:
        watched = [x for x in leaves if x.requires_grad]
        regather = _Regather(released)
        for x in watched:
            x.register_hook(regather)
    return outputs


class _Regather:
    """A gradient hook on a layer's outputs: the first gradient that reaches
    one of them gathers the layer's weights again, before its backward ops
    read them."""

    def __init__(self, weights):
        self.weights = weights

    def __call__(self, grad):
        for weight in self.weights:
            weight.restore()
        return grad


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
        self.value = None
        self.local = None
        self.storage = None
        self.nbytes = 0
        self.version = None

    def enter(self):
        """Gathers the value and lets it stand for the variable."""
        sharded = self.sharded
        # Differentiable: the gradient is reduce-scattered back to the
        # variable's shards.
        self.value = sharded.redistribute(sharded.device_mesh, self.placements)
        self.version = self.value._version
        self.variable._value = self.value
        _gathered_now.add(id(self.variable))

    def exit(self):
        """Gives the variable its sharded value back."""
        self.variable._value = self.sharded
        _gathered_now.discard(id(self.variable))

    def write_back(self):
        """Keeps what the call assigned to the variable
        (`SpectralNormalization` assigns its kernel), in its shards."""
        if self.value._version == self.version:
            return
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
            local = value.to_local()
        storage = local.untyped_storage()
        shared = [self.sharded.to_local()] + [
            x.to_local() if isinstance(x, DTensor) else x for x in outputs
        ]
        if any(
            x.untyped_storage().data_ptr() == storage.data_ptr() for x in shared
        ):
            return False
        self.local = local
        self.storage = storage
        self.nbytes = storage.nbytes()
        storage.resize_(0)
        # Once the weight's gradient is complete, every backward op that
        # read the gathered value has run.
        value.register_hook(self._release_after_backward)
        # Held weakly from now on: if autograd saved neither the value nor
        # a view of it (the first layer's kernel, whose input needs no
        # gradient), it is gone once the call returns, and the backward
        # pass need not gather it again.
        self.value = weakref.ref(value)
        return True

    def restore(self):
        """Gathers the value again into its storage, if it was freed and
        autograd still holds it."""
        if self.storage is None or self.storage.nbytes() == self.nbytes:
            return
        if self.value() is None:
            return
        with torch.no_grad():
            fresh = self.sharded.redistribute(
                self.sharded.device_mesh, self.placements
            ).to_local()
            self.storage.resize_(self.nbytes)
            self.local.copy_(fresh)

    def _release_after_backward(self, grad):
        if self.storage is not None:
            self.storage.resize_(0)
        return grad
