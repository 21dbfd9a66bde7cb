"""Layer calls under a distribution.

Inside a layer call (and a training step), a plain tensor is a global value
replicated on every process, as a plain array is in JAX. Outputs that are
partial sums (a row-parallel kernel) are reduced as the layer returns, as
Megatron's and torch's `RowwiseParallel` layers do, and so are the partial
sums of a replicated output's gradient as they reach the layer (Megatron's
`f`), but for a layer whose backward keeps them partial at no cost (a
linear projection with replicated weights, a layer with no weights).
"""

import contextlib
import functools
import os
import threading
import warnings

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend
from torch.nn.attention import sdpa_kernel

from keras.src import tree
from keras.src.backend.common.keras_tensor import KerasTensor
from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.common.masking import set_keras_mask
from keras.src.backend.torch.distributed.core import layout_rules
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import random_draws
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import (
    implicit_replication,
)
from keras.src.backend.torch.distributed.data_parallel import batch_coupling
from keras.src.backend.torch.distributed.data_parallel import coupled_layers
from keras.src.backend.torch.distributed.data_parallel import local_rows
from keras.src.backend.torch.distributed.dtensor_gaps import fallback
from keras.src.backend.torch.distributed.fsdp import fsdp
from keras.src.backend.torch.distributed.tensor_parallel import pairing_check

CHECK_REPLICATION_ENV = "KERAS_DISTRIBUTION_CHECK_REPLICATION"
# Marks a layer output whose gradient a layer call has hooked.
GRADIENT_HOOK_ATTRIBUTE = "_keras_distribution_gradient_hook"

# How many `replicated_plain_tensors` contexts are open (they nest), in
# the whole process: the `implicit_replication` flag they set is torch's,
# one for the process, and only the outermost entry may clear it.
_replication_depth = 0
# Whether a distribution is set in this process (`hold_replication`), which
# keeps the flag on outside layer calls and steps too.
_replication_held = False
# The open `implicit_replication` context while the flag is on, else None.
_implicit_replication = None
# How many `call_layer` calls are running in this thread (a model calls its
# layers): the depth of the calls a thread makes, not a step's state; per
# thread, as Keras' own call context is (a layer called by a data loader's
# thread is not nested in the model the main thread calls).
_calls = threading.local()


def _call_depth():
    return getattr(_calls, "depth", 0)


def call_layer(call_function, layer, *args, **kwargs):
    """Calls a Keras layer under the distribution in effect.

    Plain tensor inputs are global values: they enter the call as replicated
    DTensors (so that autograd saves DTensors); inside the call, see
    `replicated_plain_tensors`. Partial sums: see the module docstring and
    `_partial_gradient_axes`. With `KERAS_DISTRIBUTION_CHECK_REPLICATION=1`,
    the outermost call's plain inputs are first checked to be identical on
    all processes. A model's first call checks its layout rules.

    Args:
        call_function: `call_function(layer, *args, **kwargs)` calls it.
        layer: the layer.
        *args: the positional arguments of the call.
        **kwargs: the keyword arguments of the call.

    Returns:
        The outputs of the layer.
    """
    distribution = runtime.current_distribution()
    # Inside `torch.compile` the step function has entered the context
    # already: dynamo cannot trace the context manager itself.
    if distribution is None or torch.compiler.is_compiling():
        if not runtime.suspended_depth:
            return call_function(layer, *args, **kwargs)
        batch = coupled_layers.routing(layer)  # In a call on local rows.
        if batch is None:
            outputs = call_function(layer, *args, **kwargs)
        else:
            # A layer that couples samples, through DTensor.
            through_dtensor = functools.partial(
                _call_with_dtensors, call_function, layer, None
            )
            outputs = coupled_layers.call(
                through_dtensor,
                replicated_plain_tensors,
                layer,
                batch,
                args,
                kwargs,
            )
        return batch_coupling.record(layer, outputs)
    trace = pairing_check.active_trace()
    if trace is not None:
        # The auto plan's trace of a block, on stand-ins: no layout.
        return trace.call_layer(call_function, layer, args, kwargs)
    if _replication_depth == 0 and os.environ.get(CHECK_REPLICATION_ENV) == "1":
        check_replicated((args, kwargs), "layer call input")
    if _call_depth() == 0:
        # A per-sample model under data parallelism.
        through_dtensor = functools.partial(
            _call_with_dtensors, call_function, layer, distribution
        )
        outputs = local_rows.call(
            call_function, layer, args, kwargs, through_dtensor
        )
        if outputs is not None:
            layout_rules.check_model(layer, distribution)
            return outputs
    outputs = _call_with_dtensors(
        call_function, layer, distribution, args, kwargs
    )
    return batch_coupling.record(layer, outputs)


def _call_with_dtensors(call_function, layer, distribution, args, kwargs):
    """`call_layer`'s call of `layer` on `DTensor`s (under the distribution
    in effect when `distribution` is `None`)."""
    if distribution is None:
        distribution = runtime.current_distribution()
    mesh = distribution.device_mesh.backend_mesh
    args, kwargs = tree.map_structure(
        functools.partial(layouts.replicate, mesh=mesh), (args, kwargs)
    )
    symbolic = _is_symbolic((args, kwargs))
    _calls.depth = _call_depth() + 1
    try:
        with (
            random_draws.one_key_per_call(),
            replicated_plain_tensors(),
            fallback.dtensor_fallback(),
            # Weights sharded over the batch axis, one layer at a time.
            fsdp.gathered_weights(layer, distribution, not symbolic) as release,
        ):
            outputs = release(call_function(layer, *args, **kwargs))
    finally:
        _calls.depth -= 1
    if _calls.depth == 0 and not symbolic:
        # The outermost call on data (not while a functional model that
        # calls this one is built): a whole model, built by now.
        layout_rules.check_model(layer, distribution)
    if _calls.depth == 0 and symbolic and _has_keras_tensors((args, kwargs)):
        # A functional model being built calls `layer`: its weights are
        # neither loaded nor copied into optimizer slots yet.
        pairing_check.check_layer(layer, distribution, args, kwargs)
    partial_axes = ()
    if not symbolic and torch.is_grad_enabled():
        partial_axes = _partial_gradient_axes(layer, mesh.ndim, (args, kwargs))
    output = functools.partial(_layer_output, partial_axes=partial_axes)
    return tree.map_structure(output, outputs)


def _partial_gradient_axes(layer, ndim, inputs):
    """The mesh dimensions over which `layer`'s backward takes a partial-sum
    output gradient as it is.

    A gradient's partial sums are reduced where they are smallest and
    fewest: once, where the value's producer gets them all. A `Dense` or
    `EinsumDense` with no activation is linear, and its backward multiplies
    the output gradient by its kernel: for a partial sum over an axis its
    weights are replicated on, DTensor gives partial sums of the input and
    weight gradients with no collective. The input's joins the other
    partial sums its producer gets (a query's, beside key/value heads that
    the model axis does not divide), which the producer's one all-reduce
    makes whole, and the weights' join the step's one reduction of
    replicated weights: the layer's own all-reduce is saved. A layer with
    no weights and one input that needs a gradient (a rotary embedding)
    hands the partial sum on to it, for DTensor to reduce where an op needs
    it whole; with several (an `Add`, a `Dot`), each would get partial sums
    to reduce. Any other layer computes on its whole output gradient
    (`_whole_output_gradient`).

    Args:
        layer: the layer called.
        ndim: the number of mesh dimensions.
        inputs: the arguments of the call.

    Returns:
        A tuple of mesh dimension indices.
    """
    from keras.src import activations
    from keras.src import layers

    if not isinstance(layer, (layers.Dense, layers.EinsumDense)):
        if layer.weights or _differentiated_inputs(inputs) > 1:
            return ()
        return tuple(range(ndim))
    if getattr(layer, "quantization_mode", None) is not None or (
        getattr(layer, "activation", None) not in (None, activations.linear)
    ):
        return ()
    axes = set(range(ndim))
    for variable in layer.weights:
        value = variable._value
        # A plain tensor is a global value: replicated everywhere.
        if isinstance(value, DTensor):
            axes &= {
                d for d, p in enumerate(value.placements) if not p.is_shard()
            }
    return tuple(sorted(axes))


def _differentiated_inputs(inputs):
    """How many tensors of `inputs` need a gradient."""
    return sum(
        1
        for x in tree.flatten(inputs)
        if isinstance(x, torch.Tensor) and x.requires_grad
    )


def _is_symbolic(values):
    """Whether `values` hold symbolic tensors: `KerasTensor`s, or torch
    tensors on the meta device (as `compute_output_spec` runs layers)."""
    return any(
        isinstance(x, KerasTensor)
        or (isinstance(x, torch.Tensor) and x.is_meta)
        for x in tree.flatten(values)
    )


def _has_keras_tensors(values):
    return any(isinstance(x, KerasTensor) for x in tree.flatten(values))


def _layer_output(x, partial_axes=()):
    """A layer output with its partial sums and their gradients reduced.

    Args:
        x: an output of a layer call.
        partial_axes: mesh dimensions over which the output's gradient may
            stay a partial sum (`_partial_gradient_axes`).
    """
    if not isinstance(x, DTensor):
        return x
    mesh = x.device_mesh
    output = layouts.redistribute(
        x, mesh, layouts.reduced_placements(x.placements)
    )
    if (
        output.requires_grad
        and torch.is_grad_enabled()
        and not _hooked_by_inner_layer(output)
        and any(
            p.is_replicate() and mesh.size(d) > 1
            for d, p in enumerate(output.placements)
        )
    ):
        # A hook, not an autograd Function: the output stays the tensor
        # it was, which the next layer may update in place.
        output.register_hook(
            functools.partial(
                _whole_output_gradient,
                placements=output.placements,
                partial_axes=partial_axes,
            )
        )
        setattr(output, GRADIENT_HOOK_ATTRIBUTE, True)
    mask = get_keras_mask(x)
    if output is not x and mask is not None:
        # A mask the layer attached to its output stays with it.
        set_keras_mask(output, mask)
    return output


def _hooked_by_inner_layer(output):
    """Whether `output` is an inner layer's output returned as it is (a
    router's logits from a mixture-of-experts block), or a view of one.

    Its gradient goes to that layer's backward alone (through the view's,
    which is linear), and the inner call's hook prepares it
    (`_partial_gradient_axes`): a second hook, for the outer layer, would
    make a partial sum that the inner layer keeps partial whole, at a
    collective. A view counts as the output itself since module backward
    hooks (`CommDebugMode`'s module tracker) return views of every
    module's outputs.
    """
    while output is not None:
        if getattr(output, GRADIENT_HOOK_ATTRIBUTE, False):
            return True
        output = output._base
    return False


def _whole_output_gradient(grad, placements, partial_axes=()):
    """A replicated layer output's gradient, whole on the axes where the
    output is.

    The gradient of a replicated layer output arrives as a partial sum when
    column-parallel layers consumed the output, and sharded when a consumer's
    backward split it (DTensor's backward of a scatter or an index, as a
    mixture of experts dispatches tokens, shards the rows over the model
    axis). Made whole here, once autograd has summed what all consumers
    sent, the layer's own backward runs on the whole gradient (Megatron's
    `f` operator), and its weights' gradients are whole too. Left to
    DTensor, the backward of e.g. a LayerNorm reduce-scatters and
    all-gathers it instead, or computes on each process' rows, and leaves
    partial-sum weight gradients to all-reduce as well.
    """
    if not isinstance(grad, DTensor):
        return grad
    whole = []
    for axis, (p, target) in enumerate(zip(grad.placements, placements)):
        if p.is_partial() and axis in partial_axes:
            whole.append(p)
        elif p.is_partial() or target.is_replicate():
            whole.append(target)
        else:
            whole.append(p)
    return layouts.redistribute(grad, grad.device_mesh, whole)


@contextlib.contextmanager
def replicated_plain_tensors():
    """Treats plain tensors as replicated global values (JAX semantics).

    Entered around layer calls and training steps: the inputs and the
    constants that ops create inside them are plain tensors, which DTensor
    ops then take as replicated. Only the outermost entry acts. On CPU
    meshes, attention also runs the math kernel of
    `scaled_dot_product_attention`, as DTensor has no sharding rule for the
    CPU flash kernel.

    Yields:
        None.
    """
    global _replication_depth
    _replication_depth += 1
    try:
        if _replication_depth > 1:
            yield
            return
        _update_implicit_replication()
        with contextlib.ExitStack() as stack:
            mesh = runtime.current_distribution().device_mesh.backend_mesh
            if mesh.device_type == "cpu":
                stack.enter_context(sdpa_kernel(SDPBackend.MATH))
            yield
    finally:
        _replication_depth -= 1
        _update_implicit_replication()


def hold_replication(distribution):
    """Treats plain tensors as replicated while `distribution` is set.

    Code outside layer calls and steps mixes plain tensors with layer
    outputs too: keras-hub's `generate` stacks the caches its layers return
    with the zeros it made for the layers that left theirs untouched. As
    in JAX, where a plain array is a replicated value wherever it meets a
    sharded one, the flag stays on as long as the process has a
    distribution (`set_distribution`, `Distribution.scope()`).

    Args:
        distribution: the process' distribution, or `None`.
    """
    global _replication_held
    if not runtime.DTENSOR_AVAILABLE:
        return
    if distribution is not None and not _replication_held:
        # DTensor warns, on every process, each time it takes a plain
        # tensor of one element (a keras-hub sampling step's index) as
        # replicated: here that is the rule, not an accident.
        warnings.filterwarnings(
            "ignore",
            message="Found a non-scalar tensor with numel=1",
            category=UserWarning,
        )
    _replication_held = distribution is not None
    _update_implicit_replication()


def _update_implicit_replication():
    """Turns torch's process-wide `implicit_replication` flag on while a
    context or a distribution wants it, off when none does any more."""
    global _implicit_replication
    wanted = _replication_held or _replication_depth > 0
    if wanted and _implicit_replication is None:
        _implicit_replication = contextlib.ExitStack()
        _implicit_replication.enter_context(implicit_replication())
    elif not wanted and _implicit_replication is not None:
        _implicit_replication.close()
        _implicit_replication = None


def loop_function(function):
    """A `while_loop` body or condition, run under the distribution.

    Loop bodies such as keras-hub's sampling loop mix layer outputs with
    plain tensors outside any layer; as in layer calls, the plain tensors
    are taken as replicated global values.

    Args:
        function: the loop's `cond` or `body`.

    Returns:
        `function` itself without a distribution, else a function that
        calls it inside `replicated_plain_tensors`.
    """
    if runtime.current_distribution() is None:
        return function

    @functools.wraps(function)
    def replicated_function(*args):
        with replicated_plain_tensors(), fallback.dtensor_fallback():
            return function(*args)

    return replicated_function


def loop_condition(cond):
    """A `while_loop` condition, run under the distribution.

    As `loop_function`; besides, the loop reads the condition's result as
    a Python `bool`, outside any layer call: a `DTensor` result (a
    reduction over a sharded batch, such as keras-hub's "every prompt has
    stopped") is made its global value first, which every process reads
    alike. DTensor would read each process' own part of it, and the
    processes would leave the loop at different steps.

    Args:
        cond: the loop's condition.

    Returns:
        `cond` itself without a distribution, else a function that calls
        it under the distribution and returns a plain value.
    """
    function = loop_function(cond)
    if function is cond:
        return cond

    @functools.wraps(cond)
    def global_condition(*args):
        result = function(*args)
        if isinstance(result, DTensor):
            result = result.full_tensor()
        return result

    return global_condition


def check_replicated(values, name):
    """Raises if plain tensors in `values` differ between processes.

    A collective: all processes must call it with the same structure.

    Args:
        values: a tensor or nested structure of them; `DTensor`s and
            non-tensors are skipped.
        name: what the values are, for the error message.
    """
    leaves = [
        (path, x)
        for path, x in tree.flatten_with_path(values)
        if isinstance(x, torch.Tensor)
        and not isinstance(x, DTensor)
        and not x.is_meta
    ]
    if runtime.world_size() == 1 or not leaves:
        return
    digests = torch.stack([_digest(x) for _, x in leaves])
    gathered = [torch.empty_like(digests) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, digests)
    for (path, x), *per_rank in zip(leaves, *gathered):
        differing = [
            r for r, d in enumerate(per_rank) if not torch.equal(d, per_rank[0])
        ]
        if differing:
            raise ValueError(
                f"The {name} at {path} (shape {tuple(x.shape)}) is a plain "
                "tensor, which Keras treats as one global value replicated "
                "on every process, but it differs on processes "
                f"{differing} from process 0. Pass the same value on every "
                "process, or distribute it explicitly with "
                "`keras.distribution.distribute_tensor`."
            )


def _digest(x):
    """A few numbers that differ when two tensors differ."""
    x = x.detach().to(runtime.comm_device()).reshape(-1).to(torch.float64)
    weights = torch.arange(
        1, x.numel() + 1, dtype=torch.float64, device=x.device
    )
    return torch.stack([x.sum(), (x * weights).sum(), (x * x).sum()])
