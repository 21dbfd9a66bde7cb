"""Variables under a distribution: `DTensor` parameters laid out by
`get_variable_layout`, created from process 0's value, assigned, read whole."""

import torch
import torch.distributed as dist

from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import local_state
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.health import agreement
from keras.src.backend.torch.distributed.health import call_agreement

BROADCAST_PIECE_BYTES = 1024 * 1024


def initialize_variable(variable):
    """The parameter a new `variable` holds, laid out by the distribution (at
    the end of `Variable._initialize`); else, or on meta, its plain value."""
    distribution = runtime.current_distribution()
    value = variable._value
    if distribution is None or value.is_meta or isinstance(value, DTensor):
        return value
    if variable._shape is None:
        variable._shape = variable._validate_shape(value.shape)
    layout = distribution.get_variable_layout(variable)
    if layout is None:
        return value
    variable._layout = layout
    torch_layout = layouts.as_torch_layout(layout)
    layouts.check_rank(value, torch_layout, f"variable '{variable.path}'")
    agreement.check_same_variable(variable.path, value.shape, value.dtype)
    sharded = distribute_variable(value, torch_layout)
    runtime.log_debug(
        "variable %s: axes %s -> %s, global %s, local %s",
        variable.path,
        getattr(layout, "axes", None),
        torch_layout.placements,
        tuple(sharded.shape),
        tuple(sharded.to_local().shape),
    )
    parameter = torch.nn.Parameter(
        sharded, requires_grad=value.requires_grad and variable.trainable
    )
    # Named in the error of a read that some processes do not make.
    parameter.keras_variable_path = variable.path
    return parameter


def distribute_variable(value, layout):
    """A `DTensor` of process 0's `value` (so differently seeded initializers
    agree) laid out as `layout`, broadcast in pieces (bounding the memory)."""
    layout = layouts.as_torch_layout(layout)
    layouts.check_rank(value, layout, "variable")
    value = value.detach()
    mesh, placements = layout.device_mesh, layout.placements
    if isinstance(value, DTensor):
        return value.redistribute(mesh, placements)
    if value.device.type != mesh.device_type:
        value = value.to(mesh.device_type)
    region = layouts.local_region(value.shape, mesh, placements)
    local = _broadcast_region(value, region)
    return layouts.dtensor_from_local(local, mesh, placements, value.shape)


def _broadcast_region(value, region):
    """Broadcasts process 0's `value`; returns `value[region]` of it."""
    if value.ndim == 0:
        return _broadcast_region(value.reshape(1), (slice(0, 1),)).reshape(())
    local = value.new_empty([s.stop - s.start for s in region])
    if value.numel() == 0:
        return local
    is_source = dist.get_rank() == 0
    value = value.contiguous() if is_source else value
    rows = value.shape[0]
    row_bytes = value.numel() // rows * value.element_size()
    rows_per_piece = max(1, BROADCAST_PIECE_BYTES // row_bytes)
    rows_kept, columns_kept = region[0], region[1:]
    whole_rows = columns_kept == tuple(slice(0, n) for n in value.shape[1:])
    scratch = None
    for start in range(0, rows, rows_per_piece):
        stop = min(start + rows_per_piece, rows)
        low, high = max(start, rows_kept.start), min(stop, rows_kept.stop)
        kept = local[low - rows_kept.start : high - rows_kept.start]
        if is_source:
            piece = value[start:stop]
        elif whole_rows and low == start and high == stop:
            piece = kept
        else:
            if scratch is None:
                scratch = value.new_empty((rows_per_piece, *value.shape[1:]))
            piece = scratch[: stop - start]
        dist.broadcast(piece, src=0)
        if low < high and piece is not kept:
            kept.copy_(
                piece[(slice(low - start, high - start),) + columns_kept]
            )
    return local


def match_layout(value, reference):
    """Lays out `value` like the variable value `reference`, for assignment."""
    if not isinstance(reference, DTensor):
        return to_global_value(value)
    mesh, placements = reference.device_mesh, reference.placements
    if isinstance(value, DTensor):
        return value.redistribute(mesh, placements)
    value = torch.as_tensor(value, device=reference.device)
    local = _local_part(value, reference)
    return layouts.dtensor_from_local(local, mesh, placements, value.shape)


def assign(target, value):
    """Copies `value` (a `DTensor` or the global value) into `target`: a weight
    via DTensor (autograd and `fsdp_call` check its version), state locally."""
    if not isinstance(target, DTensor):
        target.copy_(to_global_value(value))
    elif target.requires_grad:
        target.copy_(match_layout(value, target))
    elif isinstance(value, DTensor):
        target.to_local().copy_(_local_part(value, target))
    else:
        # Replicated state (a metric's) is the value whole: no region cut.
        local = local_state.replicated_local(target)
        if local is None:
            local, value = target.to_local(), _local_part(value, target)
        local.copy_(torch.as_tensor(value, device=local.device))


def _local_part(value, reference):
    """This process' part of `value` laid out like the `DTensor` `reference`
    (a plain `value` is the same on every process: each cuts its own)."""
    mesh, placements = reference.device_mesh, reference.placements
    if isinstance(value, DTensor):
        return value.redistribute(mesh, placements).to_local()
    value = torch.as_tensor(value, device=reference.device)
    return value[layouts.local_region(value.shape, mesh, placements)]


def operand_like(value, reference):
    """`value` fit for arithmetic with the variable value `reference`: cut like
    a `DTensor` `reference` when of its shape, else replicated."""
    if not isinstance(reference, DTensor):
        return value
    if isinstance(value, DTensor) or not hasattr(value, "shape"):
        return value
    value = torch.as_tensor(value, device=reference.device)
    if value.ndim == 0:
        return value
    if tuple(value.shape) == tuple(reference.shape):
        return match_layout(value, reference)
    return layouts.replicate(value, reference.device_mesh)


def to_global_value(x):
    """Returns the global value of `x` as a plain tensor (a collective)."""
    if not isinstance(x, DTensor):
        return x
    if all(p.is_replicate() for p in x.placements):
        return x.to_local()
    path = getattr(x, "keras_variable_path", None)
    what = f"variable '{path}'" if path else f"a tensor of shape {x.shape}"
    read = f"a read of the global value of {what}, laid out as {x.placements}"
    with call_agreement.collective_call(read):
        return x.full_tensor()


def rebind_module_parameter(module, name, parameter):
    """Makes `module.<name>` refer to `parameter`, so a wrapped torch module
    computes with the distributed parameter, not the one it was built with."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if dict(owner.named_parameters(recurse=False)).get(leaf) is not parameter:
        owner.register_parameter(leaf, parameter)
