"""Ops that DTensor alone would not compute as one process does.

DTensor convolves a sharded kernel wrongly, and draws random numbers per
shard. The torch backend's convolution and dropout hand their operands here
first.
"""

import torch

from keras.src.backend.torch.distributed import layouts
from keras.src.backend.torch.distributed import runtime
from keras.src.backend.torch.distributed.runtime import DTensor

if runtime.DTENSOR_AVAILABLE:
    from torch.distributed.tensor import Replicate


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


def dropout(inputs, rate):
    """`torch.nn.functional.dropout`, global for a `DTensor`.

    DTensor's own random ops draw per shard (and, on CPU meshes, from each
    process' generator). Here the noise of the whole tensor is drawn the way
    torch's dropout draws it, on every process, from the generator state of
    process 0 (broadcast first: processes may have been seeded differently),
    so all copies of the tensor agree and the result equals that of one
    process with the same torch seed.

    Args:
        inputs: a tensor.
        rate: the probability of dropping an element.

    Returns:
        The tensor with dropout applied.
    """
    if not isinstance(inputs, DTensor):
        return torch.nn.functional.dropout(inputs, p=rate, training=True)
    runtime.sync_torch_rng()
    noise = torch.empty(inputs.shape, dtype=inputs.dtype, device=inputs.device)
    noise.bernoulli_(1 - rate)
    noise.div_(1 - rate)
    return inputs * layouts.replicate(noise, inputs.device_mesh)
