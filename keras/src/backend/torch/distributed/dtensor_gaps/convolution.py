"""Convolutions by a kernel sharded on channels: DTensor's conv rule keeps the
input's placements whatever the kernel's, labelling each process' channels as
the whole output, then fails to differentiate it (pytorch/pytorch#186129)."""

try:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate
except ImportError:  # A torch without DTensor: Keras' backend still imports.
    DTensor = ()  # `isinstance(x, ())` is false: no tensor is a DTensor.


def conv_operands(inputs, kernel):
    """`(inputs, kernel)` as DTensor convolves them correctly: inputs sharded on
    batch only, the kernel replicated; the rest gathered, differentiably."""
    operands = []
    for x in (inputs, kernel):
        if isinstance(x, DTensor):
            target = [
                p if p.is_shard(0) and x is inputs else Replicate()
                for p in x.placements
            ]
            if target != list(x.placements):
                x = x.redistribute(x.device_mesh, target)
        operands.append(x)
    return tuple(operands)
