"""Layer calls under a distribution: plain tensors as replicated global values
(as in JAX), partial-sum outputs reduced on return, replicated outputs' partial
gradients as backward needs them (Megatron's `f`), plus `techniques`."""

import contextlib
import dataclasses
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
from keras.src.backend.torch.distributed.dtensor_gaps import fallback

CHECK_REPLICATION_ENV = "KERAS_DISTRIBUTION_CHECK_REPLICATION"
GRADIENT_HOOK_ATTRIBUTE = "_keras_distribution_gradient_hook"
# Process-wide, as torch's `implicit_replication` flag is.
_replication_depth, _replication_held, _implicit_replication = 0, False, None
# Process-wide, as torch's SDPA flags are: the backends enabled outside the
# outermost `replicated_plain_tensors` that made a CPU mesh use math SDPA
# (`None`: it did not), and the depth of `plain_tensor_kernels`.
_outer_sdpa_backends, _plain_kernels_depth = None, 0
# Whether the outermost entry left math SDPA to the entries within it.
_math_within = False
_calls = threading.local()  # `_call_global` depth, per thread as Keras' calls.


@dataclasses.dataclass
class Techniques:
    """What techniques add to layer calls (none by default): `rows_call`, an
    outermost call's outputs on local rows (`None`: `through` on DTensors);
    `suspended_call`, one inside it on rows; `record`, a call's DTensor outputs;
    `weights`, a context around it yielding a function of its outputs; `trace`,
    this thread's call taker or `None`; `built`, a functional model built."""

    rows_call: object = lambda *args: None
    suspended_call: object = lambda call_function, layer, args, kwargs, *_: (
        call_function(layer, *args, **kwargs)
    )
    record: object = lambda layer, outputs: outputs
    weights: object = lambda *args: contextlib.nullcontext(lambda x: x)
    trace: object = lambda: None
    built: object = lambda *args: None


techniques = Techniques()  # Set once by `distribution_lib` as it composes them.


def call_layer(call_function, layer, *args, **kwargs):
    """Calls `layer` via `call_function`, plain tensor inputs as replicated
    DTensors (for autograd to save), checked if `CHECK_REPLICATION_ENV`=1."""
    distribution = runtime.current_distribution()
    # Under `torch.compile` the step entered the context (dynamo can't).
    if distribution is None or torch.compiler.is_compiling():
        if not runtime.suspended_depth:
            return call_function(layer, *args, **kwargs)
        through = functools.partial(_call_global, call_function, layer)
        outputs = techniques.suspended_call(
            call_function,
            layer,
            args,
            kwargs,
            through,
            replicated_plain_tensors,
        )
        return techniques.record(layer, outputs)
    trace = techniques.trace()
    if trace is not None:
        return trace.call_layer(call_function, layer, args, kwargs)
    if _replication_depth == 0 and os.environ.get(CHECK_REPLICATION_ENV) == "1":
        check_replicated((args, kwargs), "layer call input")
    if getattr(_calls, "depth", 0) == 0:
        through = functools.partial(
            _call_global, call_function, layer, distribution=distribution
        )
        outputs = techniques.rows_call(
            call_function, layer, args, kwargs, through
        )
        if outputs is not None:
            layout_rules.check_model(layer, distribution)
            return outputs
    outputs = _call_global(call_function, layer, args, kwargs, distribution)
    return techniques.record(layer, outputs)


def _call_global(call_function, layer, args, kwargs, distribution=None):
    """Calls `layer` on `DTensor`s (`distribution=None`: the current one)."""
    distribution = distribution or runtime.current_distribution()
    mesh = distribution.device_mesh.backend_mesh
    args, kwargs = tree.map_structure(
        functools.partial(layouts.replicate, mesh=mesh), (args, kwargs)
    )
    leaves = tree.flatten((args, kwargs))
    keras_tensors = any(isinstance(x, KerasTensor) for x in leaves)
    symbolic = keras_tensors or any(
        isinstance(x, torch.Tensor) and x.is_meta for x in leaves
    )
    _calls.depth = getattr(_calls, "depth", 0) + 1
    try:
        with (
            random_draws.one_key_per_call(),
            replicated_plain_tensors(),
            fallback.dtensor_fallback(),
            techniques.weights(layer, distribution, not symbolic) as release,
        ):
            outputs = release(call_function(layer, *args, **kwargs))
    finally:
        _calls.depth -= 1
    if _calls.depth == 0 and not symbolic:
        # The outermost call on data: a whole model, built by now.
        layout_rules.check_model(layer, distribution)
    if _calls.depth == 0 and keras_tensors:
        # A functional model being built: weights not loaded or copied yet.
        techniques.built(layer, distribution, args, kwargs)
    axes = ()
    if not symbolic and torch.is_grad_enabled():
        axes = _partial_gradient_axes(layer, mesh.ndim, (args, kwargs))
    return tree.map_structure(functools.partial(_layer_output, axes), outputs)


def _partial_gradient_axes(layer, ndim, inputs):
    """Mesh dims where `layer`'s backward can take a partial-sum output
    gradient as is: those a linear `Dense`'s or `EinsumDense`'s weights are
    replicated on; all for a weightless layer of one differentiated input."""
    from keras.src import activations
    from keras.src import layers

    if not isinstance(layer, (layers.Dense, layers.EinsumDense)):
        if layer.weights or _differentiated_inputs(inputs) > 1:
            return ()
    elif getattr(layer, "quantization_mode", None) is not None or (
        getattr(layer, "activation", None) not in (None, activations.linear)
    ):
        return ()
    axes = set(range(ndim))
    for value in (v._value for v in layer.weights):
        if isinstance(value, DTensor):
            axes &= {
                d for d, p in enumerate(value.placements) if not p.is_shard()
            }
    return tuple(sorted(axes))


def _differentiated_inputs(inputs):
    """How many tensors of `inputs` need a gradient."""
    return sum(
        isinstance(x, torch.Tensor) and x.requires_grad
        for x in tree.flatten(inputs)
    )


def _layer_output(axes, x):
    """`x` with partial sums reduced, and their gradients but over `axes`."""
    if not isinstance(x, DTensor):
        return x
    mesh = x.device_mesh
    y = layouts.redistribute(x, mesh, layouts.reduced_placements(x.placements))
    if (
        y.requires_grad
        and torch.is_grad_enabled()
        and not _hooked_by_inner_layer(y)
        and any(
            p.is_replicate() and mesh.size(d) > 1
            for d, p in enumerate(y.placements)
        )
    ):
        # A hook, not a Function: the next layer may alter this tensor in place.
        y.register_hook(functools.partial(_whole_gradient, y.placements, axes))
        setattr(y, GRADIENT_HOOK_ATTRIBUTE, True)
    mask = get_keras_mask(x)
    if y is not x and mask is not None:
        set_keras_mask(y, mask)
    return y


def _hooked_by_inner_layer(output):
    """Whether `output` is (a view of, as module backward hooks return) an
    inner layer's output, whose hook prepares its gradient."""
    while output is not None and not hasattr(output, GRADIENT_HOOK_ATTRIBUTE):
        output = output._base
    return output is not None


def _whole_gradient(placements, axes, grad):
    """A replicated output's gradient, whole where the output is, not on `axes`
    (Megatron's `f`): DTensor would leave LayerNorm weight gradients partial."""
    if not isinstance(grad, DTensor):
        return grad
    whole = [
        p if (d in axes if p.is_partial() else not t.is_replicate()) else t
        for d, (p, t) in enumerate(zip(grad.placements, placements))
    ]
    return layouts.redistribute(grad, grad.device_mesh, whole)


@contextlib.contextmanager
def replicated_plain_tensors(math_sdpa=True):
    """Treats plain tensors as replicated global values (outermost entry acts);
    CPU meshes use math SDPA: DTensor has no rule for the CPU flash kernel
    (again inside `plain_tensor_kernels`, for a call on DTensors there). With
    `math_sdpa=False` (a step of plain tensors) only entries within switch."""
    global _replication_depth, _outer_sdpa_backends, _math_within
    _replication_depth += 1
    try:
        if _replication_depth > 1:
            within = _plain_kernels_depth or _math_within
            with _math_sdpa() if within else _no_context():
                yield
            return
        _update_implicit_replication()
        mesh = runtime.current_distribution().device_mesh.backend_mesh
        if mesh.device_type != "cpu":
            yield
            return
        if not math_sdpa:
            _math_within = True
            try:
                yield
            finally:
                _math_within = False
            return
        _outer_sdpa_backends = _enabled_sdpa_backends()
        try:
            with _math_sdpa():
                yield
        finally:
            _outer_sdpa_backends = None
    finally:
        _replication_depth -= 1
        _update_implicit_replication()


@contextlib.contextmanager
def plain_tensor_kernels():
    """Runs a call on plain local tensors with the SDPA backends enabled
    outside `replicated_plain_tensors` (one process' kernels, the CPU flash
    one included) where it made them math SDPA."""
    global _plain_kernels_depth
    backends = _outer_sdpa_backends
    if not backends or _plain_kernels_depth:
        yield
        return
    _plain_kernels_depth += 1
    try:
        with sdpa_kernel(backends):
            yield
    finally:
        _plain_kernels_depth -= 1


def _math_sdpa():
    return sdpa_kernel(SDPBackend.MATH)


def _no_context():
    return contextlib.nullcontext()


def _enabled_sdpa_backends():
    """The SDPA backends torch's flags enable now."""
    flags = torch.backends.cuda
    return [
        backend
        for backend, enabled in (
            (SDPBackend.FLASH_ATTENTION, flags.flash_sdp_enabled),
            (SDPBackend.EFFICIENT_ATTENTION, flags.mem_efficient_sdp_enabled),
            (SDPBackend.MATH, flags.math_sdp_enabled),
            (SDPBackend.CUDNN_ATTENTION, flags.cudnn_sdp_enabled),
        )
        if enabled()
    ]


def hold_replication(distribution):
    """Treats plain tensors as replicated while `distribution` is set, as code
    outside layer calls and steps mixes them with layer outputs."""
    global _replication_held
    if distribution is not None and not _replication_held:
        # DTensor warns of each one-element plain tensor taken as replicated.
        message = "Found a non-scalar tensor with numel=1"
        warnings.filterwarnings("ignore", message, UserWarning)
    _replication_held = distribution is not None
    _update_implicit_replication()


def _update_implicit_replication():
    """Sets torch's process-wide `implicit_replication` flag as wanted."""
    global _implicit_replication
    wanted = _replication_held or _replication_depth > 0
    if wanted and _implicit_replication is None:
        _implicit_replication = contextlib.ExitStack()
        _implicit_replication.enter_context(runtime.implicit_replication())
    elif not wanted and _implicit_replication is not None:
        _implicit_replication.close()
        _implicit_replication = None


def loop_function(function, condition=False):
    """`function` (a `while_loop` body or condition) on replicated plain
    tensors; a condition's `DTensor` result gathered, lest processes diverge."""
    if runtime.current_distribution() is None:
        return function

    @functools.wraps(function)
    def replicated_function(*args):
        with replicated_plain_tensors(), fallback.dtensor_fallback():
            result = function(*args)
        if condition and isinstance(result, DTensor):
            return result.full_tensor()
        return result

    return replicated_function


loop_condition = functools.partial(loop_function, condition=True)


def check_replicated(values, name):
    """Raises if plain tensors in `values` (`name` in the message) differ
    between processes; a collective, called with the same structure on all."""
    leaves = [
        (path, x)
        for path, x in tree.flatten_with_path(values)
        if isinstance(x, torch.Tensor)
        and not isinstance(x, DTensor)
        and not x.is_meta
    ]
    if runtime.world_size() == 1 or not leaves:
        return
    digests = []
    for _, x in leaves:  # A few numbers that differ when two tensors differ.
        x = x.detach().to(runtime.comm_device()).reshape(-1).to(torch.float64)
        weights = torch.arange(1, x.numel() + 1, dtype=x.dtype, device=x.device)
        digests.append(torch.stack([x, x * weights, x * x]).sum(1))
    digests = torch.stack(digests)
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
