"""Whole-batch moments of a batch-sharded input (batch normalization), in one
all-reduce of packed sums as torch's CUDA-only `SyncBatchNorm`."""

import functools

import torch
import torch.distributed as dist

from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard
from keras.src.backend.torch.distributed.data_parallel import batch_coupling
from keras.src.backend.torch.distributed.data_parallel import coupled_layers


def batch_moments(function):
    """The backend's `moments` over the global batch, in one collective."""

    @functools.wraps(function)
    def moments(x, axes, keepdims=False, synchronized=False):
        group = coupled_layers.batch_group()
        axes = tuple(axes) if isinstance(axes, (list, tuple)) else (axes,)
        if 0 not in [a % x.ndim for a in axes]:
            return function(x, axes, keepdims, synchronized)
        with batch_coupling.explained():
            # A DTensor on local rows: a layer through `coupled_layers`.
            if isinstance(x, DTensor) and tuple(x.placements) == (Shard(0),):
                return _global_moments(x, axes, keepdims, None)
            if group is not None and not isinstance(x, DTensor):
                return _global_moments(x, axes, keepdims, group)
            return function(x, axes, keepdims, synchronized)

    return moments


def _global_moments(x, axes, keepdims, group):
    """Mean and variance from sums and squares packed in one all-reduce over
    `group` (`None`: `x` is batch-sharded); halves in float32 as upstream."""
    dtype = x.dtype
    if dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    sums = torch.sum(x, dim=axes, keepdim=True)
    squares = torch.sum(x * x, dim=axes, keepdim=True)
    parts = [sums.reshape(-1), squares.reshape(-1)]
    total = 1
    for a in axes:  # A loop: dynamo cannot trace `math.prod` of a generator.
        total *= x.shape[a]
    if group is None:
        packed = torch.cat(parts).redistribute(placements=[Replicate()])
    else:
        parts.append(sums.new_full((1,), total))
        packed = _AllReduceSum.apply(torch.cat(parts), group)
        total = packed[-1]
    size, shape = sums.numel(), sums.shape
    mean = (packed[:size] / total).reshape(shape)
    variance = (packed[size : 2 * size] / total).reshape(shape) - mean * mean
    if not keepdims:
        mean = torch.squeeze(mean, dim=axes)
        variance = torch.squeeze(variance, dim=axes)
    return mean.to(dtype), variance.to(dtype)


class _AllReduceSum(torch.autograd.Function):
    """A sum over processes whose backward pass sums the gradients too."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return _AllReduceSum.forward(ctx, grad, ctx.group), None
