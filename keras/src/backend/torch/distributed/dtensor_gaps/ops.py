"""Ops that DTensor alone would not compute as one process does.

DTensor convolves a sharded kernel wrongly and mis-reduces a sharded lookup
with sharded indices: the torch backend's convolution and `take` hand their
operands here first.
Where DTensor refuses an op, `fallback` computes it on global values
(`slice_update` on a sharded prompt included); einsum is `shard_local`'s.
"""

import torch

from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.dtensor_gaps import fallback


def conv_operands(inputs, kernel):
    """Lays out convolution operands the way DTensor can convolve them.

    DTensor convolves correctly only inputs sharded on the batch dimension
    with a replicated kernel (a sharded kernel gives wrong results), so a
    sharded kernel is gathered, and so are inputs sharded on other
    dimensions. Gathering is differentiable: kernel gradients come back
    sharded like the kernel.

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

    Layer calls and steps compute refused ops on global values already
    (`fallback`); a reshape outside them, such as keras-hub's RWKV7 building
    its generation cache by calling its layers' `call` directly, splitting
    a dimension whose shards cut its pieces (a head split between 4
    processes), is computed the same way here. DTensor refuses before it
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

    A lookup in a table sharded on a mesh axis with indices sharded on the
    same axis (Llama's and Gemma's embeddings on a 2D mesh, ids sharded on
    the batch axis) leaves DTensor's masked partial sum with a mask of the
    wrong shape (`IndexError` when it is reduced). The indices are gathered
    along such axes: they are small.

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

    A loss reduced over a sharded batch is a partial sum (each process
    holds its rows' share). `where(d == 0, 0, x / d)` is linear in `x`, so
    computed on each process' share it sums to the quotient of the whole:
    the quotient stays partial, to be reduced where its whole value is read
    (the loss tracker), with no look at the divisor's values and no
    collective. On `DTensor`s, `divide_no_nan`'s `where` would reduce it
    at once. A replicated numerator (a metric's total, divided by its
    count) is divided on the local values as well: the same numbers,
    without DTensor's dispatch of the four ops.

    Args:
        numerator: a tensor.
        divisor: a tensor.

    Returns:
        The quotient, a `DTensor` placed like `numerator`; `None` unless
        `numerator` is a `DTensor` partial (sum or average) or replicated
        on each mesh axis, and `divisor` is a constant replicated on the
        same mesh (or a plain tensor).
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
