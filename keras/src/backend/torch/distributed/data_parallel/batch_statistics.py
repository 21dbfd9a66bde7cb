"""Moments over a batch sharded across processes, as one process takes them.

Batch normalization in training normalizes with the mean and variance of
the whole batch. Under data parallelism each process holds some of its
rows; `batch_moments` takes the moments of all of them with one
all-reduce of packed sums, as torch's `SyncBatchNorm` does (which runs on
CUDA only).
"""

import functools
import math

import torch
import torch.distributed as dist

from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard
from keras.src.backend.torch.distributed.data_parallel import batch_coupling
from keras.src.backend.torch.distributed.data_parallel import local_rows


def batch_moments(function):
    """`moments` over the global batch, with one all-reduce forward.

    Moments whose axes include the batch axis (batch normalization) are
    computed from the sums of `x` and `x * x` and the count of values over
    every process' rows, all-reduced in one collective:

    - inside a call on the local rows, in one differentiable collective;
      the gradient of each process' rows comes back through the
      all-reduce;
    - on a `DTensor` batch sharded over a 1-D mesh (data parallelism
      through DTensor, compiled steps included), the two sums are packed
      into one partial sum that DTensor all-reduces once. Upstream's
      `mean(x)` and `mean(x * x)` are two partial values, each reduced on
      its own, and their gradients again: 4 collectives against 1.

    Args:
        function: the backend's `moments(x, axes, keepdims, synchronized)`.

    Returns:
        The wrapped function.
    """

    @functools.wraps(function)
    def moments(x, axes, keepdims=False, synchronized=False):
        group = local_rows.local_call_group()
        axes = tuple(axes) if isinstance(axes, (list, tuple)) else (axes,)
        if 0 not in [a % x.ndim for a in axes]:
            return function(x, axes, keepdims, synchronized)
        # What couples samples on purpose: not evidence for the probe.
        with batch_coupling.explained():
            # A DTensor in a call on local rows: a layer of it called
            # through DTensor (`coupled_layers`).
            if _batch_sharded(x):
                return _packed_moments(x, axes, keepdims)
            if group is not None and not isinstance(x, DTensor):
                return _global_moments(x, axes, keepdims, group=group)
            return function(x, axes, keepdims, synchronized)

    return moments


def _batch_sharded(x):
    """Whether `x` is a `DTensor` sharded on its first axis over a 1-D mesh
    (and only there)."""
    return (
        isinstance(x, DTensor)
        and x.device_mesh.ndim == 1
        and tuple(x.placements) == (Shard(0),)
    )


def _packed_moments(x, axes, keepdims):
    """`_global_moments` of a batch-sharded `DTensor`, through DTensor.

    The sums over the batch are partial sums; packed into one tensor,
    DTensor reduces them in one all-reduce. The count is the global
    shape's.
    """
    dtype = x.dtype
    if dtype in (torch.float16, torch.bfloat16):
        # As upstream: statistics in float32.
        x = x.float()
    sums = torch.sum(x, dim=axes, keepdim=True)
    squares = torch.sum(x * x, dim=axes, keepdim=True)
    packed = torch.cat([sums.reshape(-1), squares.reshape(-1)])
    packed = packed.redistribute(placements=[Replicate()])
    total = 1
    for a in axes:  # A loop: dynamo cannot trace `math.prod` of a generator.
        total *= x.shape[a]
    size = sums.numel()
    mean = (packed[:size] / total).reshape(sums.shape)
    variance = (packed[size:] / total).reshape(sums.shape) - mean * mean
    if not keepdims:
        mean = torch.squeeze(mean, dim=axes)
        variance = torch.squeeze(variance, dim=axes)
    return mean.to(dtype), variance.to(dtype)


def _global_moments(x, axes, keepdims, group):
    dtype = x.dtype
    if dtype in (torch.float16, torch.bfloat16):
        # As upstream: statistics in float32.
        x = x.float()
    sums = torch.sum(x, dim=axes, keepdim=True)
    squares = torch.sum(x * x, dim=axes, keepdim=True)
    count = sums.new_full((1,), math.prod(x.shape[a] for a in axes))
    packed = torch.cat([sums.reshape(-1), squares.reshape(-1), count])
    packed = _AllReduceSum.apply(packed, group)
    size = sums.numel()
    total = packed[-1]
    mean = (packed[:size] / total).reshape(sums.shape)
    variance = (packed[size : 2 * size] / total).reshape(sums.shape) - (
        mean * mean
    )
    if not keepdims:
        mean = torch.squeeze(mean, dim=axes)
        variance = torch.squeeze(variance, dim=axes)
    return mean.to(dtype), variance.to(dtype)


class _AllReduceSum(torch.autograd.Function):
    """A sum over processes; its gradient is the sum of theirs (each
    process' rows reach every process' moments)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None
