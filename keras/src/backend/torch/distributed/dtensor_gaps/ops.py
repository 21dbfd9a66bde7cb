"""Ops that DTensor alone would not compute as one process does.

DTensor convolves a sharded kernel wrongly and mis-reduces a sharded lookup
with sharded indices: convolution and `take` lay out their operands here
first. Refused ops are `fallback`'s, einsum `shard_local`'s.
"""

import torch

from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.dtensor_gaps import fallback


def conv_operands(inputs, kernel):
    """Lays out convolution operands the way DTensor can convolve them.

    DTensor convolves correctly only batch-sharded inputs with a replicated
    kernel; anything else is gathered, differentiably.

    Args:
        inputs: the convolution input.
        kernel: the convolution kernel.

    Returns:
        The pair `(inputs, kernel)`.
    """
    if isinstance(kernel, DTensor):
        mesh = kernel.device_mesh
        kernel = layouts.redistribute(kernel, mesh, [Replicate()] * mesh.ndim)
    if isinstance(inputs, DTensor):
        batch_only = [
            p if p.is_shard() and p.dim == 0 else Replicate()
            for p in inputs.placements
        ]
        inputs = layouts.redistribute(inputs, inputs.device_mesh, batch_only)
    return inputs, kernel


def reshape(x, newshape):
    """`torch.reshape`, on global values where DTensor refuses the view.

    As layer calls and steps do (`fallback`), for a reshape outside them
    splitting a dimension across shards. DTensor refuses before it
    communicates, so every process takes the same path.

    Args:
        x: a tensor.
        newshape: the new shape.

    Returns:
        `x` reshaped.
    """
    if runtime.current_distribution() is None or not isinstance(x, DTensor):
        return torch.reshape(x, newshape)
    try:
        return torch.reshape(x, newshape)
    except RuntimeError as error:
        if not fallback.is_refusal(error):
            raise
        with fallback.dtensor_fallback():
            return torch.reshape(x, newshape)


def take_operands(x, indices):
    """Lays out `take` operands the way DTensor can look them up.

    With table and indices sharded on the same mesh axis, DTensor's masked
    partial sum gets a mask of the wrong shape (`IndexError` when reduced),
    so the (small) indices are gathered along such axes.

    Args:
        x: the table.
        indices: the indices.

    Returns:
        The pair `(x, indices)`.
    """
    if not isinstance(x, DTensor) or not isinstance(indices, DTensor):
        return x, indices
    placements = [
        Replicate() if p.is_shard() and table.is_shard() else p
        for p, table in zip(indices.placements, x.placements)
    ]
    return x, layouts.redistribute(indices, indices.device_mesh, placements)


def divide_no_nan_local(numerator, divisor):
    """`divide_no_nan` computed on each process' values where that is exact.

    `where(d == 0, 0, x / d)` is linear in `x`: a partial-sum numerator (a
    loss over a sharded batch) divided share by share stays partial, reduced
    where it is read, where DTensor's `where` would reduce it at once. A
    replicated one is divided locally too, skipping DTensor's dispatch.

    Args:
        numerator: a tensor.
        divisor: a tensor.

    Returns:
        The quotient placed like `numerator`; `None` unless `numerator` is a
        `DTensor` partial (sum or average) or replicated on each mesh axis and
        `divisor` a constant plain tensor or replicated on the same mesh.
    """
    if not isinstance(numerator, DTensor) or divisor.requires_grad:
        return None
    placements = numerator.placements
    if not all(_is_linear_partial(p) or p.is_replicate() for p in placements):
        return None
    if isinstance(divisor, DTensor):
        if divisor.device_mesh != numerator.device_mesh or not all(
            p.is_replicate() for p in divisor.placements
        ):
            return None
        divisor = divisor.to_local()
    # Each share's gradient is the whole quotient's gradient.
    part = numerator.to_local(
        grad_placements=[
            Replicate() if p.is_partial() else p for p in placements
        ]
    )
    safe_divisor = torch.where(divisor == 0, torch.ones_like(divisor), divisor)
    quotient = torch.where(divisor == 0, 0, torch.divide(part, safe_divisor))
    return DTensor.from_local(
        quotient, numerator.device_mesh, placements, run_check=False
    )


def _is_linear_partial(placement):
    return placement.is_partial() and placement.reduce_op in ("sum", "avg")
