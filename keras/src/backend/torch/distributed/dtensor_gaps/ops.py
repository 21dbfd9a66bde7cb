"""Ops DTensor computes unlike one process: some reshapes, a sharded lookup by
sharded indices, `divide_no_nan` of sums."""

import torch

from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.dtensor_gaps import fallback


def reshape(x, newshape):
    """`torch.reshape`, on global values where DTensor refuses the view
    (before it communicates, so on every process alike)."""
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
    """`(x, indices)` for `take`, indices gathered on mesh axes sharding the
    table too (DTensor's masked partial sum would get a wrongly shaped mask)."""
    if not isinstance(x, DTensor) or not isinstance(indices, DTensor):
        return x, indices
    placements = [
        Replicate() if p.is_shard() and table.is_shard() else p
        for p, table in zip(indices.placements, x.placements)
    ]
    return x, layouts.redistribute(indices, indices.device_mesh, placements)


def divide_no_nan_local(numerator, divisor):
    """`divide_no_nan` on each process' values, a partial (sum, avg) or
    replicated `numerator` staying so (DTensor's `where` would reduce it);
    `None` unless so and `divisor` is constant, plain or replicated."""
    if not isinstance(numerator, DTensor) or divisor.requires_grad:
        return None
    placements = numerator.placements
    if not all(
        p.is_replicate() or (p.is_partial() and p.reduce_op in ("sum", "avg"))
        for p in placements
    ):
        return None
    if isinstance(divisor, DTensor):
        if divisor.device_mesh != numerator.device_mesh or not all(
            p.is_replicate() for p in divisor.placements
        ):
            return None
        divisor = divisor.to_local()
    # Each share's gradient is the whole quotient's gradient.
    grad = [Replicate() if p.is_partial() else p for p in placements]
    part = numerator.to_local(grad_placements=grad)
    safe_divisor = torch.where(divisor == 0, torch.ones_like(divisor), divisor)
    quotient = torch.where(divisor == 0, 0, torch.divide(part, safe_divisor))
    return DTensor.from_local(
        quotient, numerator.device_mesh, placements, run_check=False
    )
