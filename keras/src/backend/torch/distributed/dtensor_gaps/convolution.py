"""Convolutions by a kernel sharded on its channels: DTensor's convolution
rule keeps the input's placements whatever the kernel's, so it labels each
process' channels as the whole output and then fails to differentiate it
(pytorch/pytorch#186129)."""

from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate


def conv_operands(inputs, kernel):
    """`(inputs, kernel)` as DTensor convolves them correctly: inputs sharded
    on the batch only, the kernel replicated; the rest gathered,
    differentiably."""
    if isinstance(kernel, DTensor):
        kernel = _redistribute(kernel, [Replicate()] * kernel.device_mesh.ndim)
    if isinstance(inputs, DTensor):
        batch_only = [
            p if p.is_shard(0) else Replicate() for p in inputs.placements
        ]
        inputs = _redistribute(inputs, batch_only)
    return inputs, kernel


def _redistribute(x, placements):
    """`x` with `placements`, on its mesh; `x` itself if it has them."""
    if tuple(x.placements) == tuple(placements):
        return x
    return x.redistribute(x.device_mesh, placements)
