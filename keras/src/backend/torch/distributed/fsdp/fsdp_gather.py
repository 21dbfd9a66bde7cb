"""One collective for all the weights a layer call gathers, as FSDP2 does.

`redistribute` would cost 2-3 collectives per weight. `gather` pads each shard
to the largest (DTensor shards as `torch.chunk`: the last can be smaller or
empty) and all-gathers them flat, one buffer per dtype, copying each weight
to its own storage (which `fsdp` frees); partial-sum gradients take one
reduce-scatter. Other gathers and gradients use `redistribute`.
"""

import math

import torch

from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard
from keras.src.backend.torch.distributed.training import gradients


def gather(shards, placements, async_op=False):
    """Starts gathering `shards` (in the dtype to gather in) to `placements`."""
    return PendingGather(shards, placements, async_op)


class PendingGather:
    """Gathers of weights, started."""

    def __init__(self, shards, placements, async_op):
        self.shards = list(shards)
        self.placements = list(placements)
        self._groups = []
        self._alone = {}
        grouped = {}
        for index, (shard, target) in enumerate(zip(shards, placements)):
            mesh_dim = _flat_mesh_dim(shard, target)
            if mesh_dim is None:
                if async_op and shard.requires_grad and torch.is_grad_enabled():
                    # Backward, an async reduce-scatter holds its whole input
                    # until waited for: the optimizer would see whole gradients.
                    shard = shard.view_as(shard)
                    shard.register_hook(_completed_gradient)
                self._alone[index] = shard.redistribute(
                    shard.device_mesh, target, async_op=async_op
                )
                continue
            key = (shard.device_mesh, mesh_dim, shard.dtype)
            grouped.setdefault(key, []).append(index)
        for (_, mesh_dim, _), indices in grouped.items():
            self._groups.append(
                _FlatGather(
                    [self.shards[i] for i in indices],
                    [self.placements[i] for i in indices],
                    indices,
                    mesh_dim,
                    async_op,
                )
            )

    def values(self):
        """The gathered `DTensor`s; their gradients reduce-scatter to shards."""
        values = [self._alone.get(i) for i in range(len(self.shards))]
        for group in self._groups:
            gathered = _GatherFunction.apply(group, *group.shards)
            for index, value in zip(group.indices, gathered):
                values[index] = value
        return values

    def local_values(self):
        """The gathered local tensors (no autograd history), one per shard."""
        alone = {i: local_tensor(v) for i, v in self._alone.items()}
        values = [alone.get(i) for i in range(len(self.shards))]
        for group in self._groups:
            for index, value in zip(group.indices, group.local_values()):
                values[index] = value
        return values

    def wait(self):
        """Waits for the collectives to complete, dropping their results."""
        for value in self._alone.values():
            local_tensor(value)
        for group in self._groups:
            group.wait()
        self._alone, self._groups = {}, []


def _flat_mesh_dim(shard, target):
    """The mesh dim along which a flat buffer gathers `shard`, or `None`."""
    changed = [
        dim
        for dim, (now, then) in enumerate(zip(shard.placements, target))
        if now != then
    ]
    if len(changed) != 1:
        return None
    mesh_dim = changed[0]
    placement = shard.placements[mesh_dim]
    if type(placement) is not Shard or not target[mesh_dim].is_replicate():
        return None
    nested = any(
        other.is_shard(placement.dim)
        for dim, other in enumerate(shard.placements)
        if dim != mesh_dim
    )
    return None if nested else mesh_dim


def local_tensor(value):
    """The local tensor of `value`, its async collective (if any) waited for."""
    local = value.to_local() if isinstance(value, DTensor) else value
    wait = getattr(local, "wait", None)
    return local if wait is None else wait()


def _completed_gradient(grad):
    """An async gather's input gradient, its reduce-scatter waited for."""
    local = local_tensor(grad)
    if local is grad.to_local():
        return grad
    return DTensor.from_local(
        local,
        grad.device_mesh,
        grad.placements,
        shape=grad.shape,
        stride=grad.stride(),
    )


class _FlatGather:
    """One all-gather of shards along a mesh dim; reduce-scatters gradients."""

    def __init__(self, shards, placements, indices, mesh_dim, async_op):
        self.shards = shards
        self.placements = placements
        self.indices = indices
        self.mesh_dim = mesh_dim
        self.mesh = mesh = shards[0].device_mesh
        self.group = mesh.get_group(mesh_dim)
        self.size = mesh.size(mesh_dim)
        self.coordinate = mesh.get_local_rank(mesh_dim)
        self.layouts = [_ShardLayout(x, mesh_dim, self.size) for x in shards]
        with torch.no_grad():
            flat = _concatenated(
                [
                    layout.padded(x.to_local()).reshape(-1)
                    for layout, x in zip(self.layouts, shards)
                ]
            )
        self._buffer = flat.new_empty(self.size * flat.numel())
        self._work = runtime.all_gather_flat(
            self._buffer, flat, group=self.group, async_op=async_op
        )

    def wait(self):
        """Waits for the all-gather to complete; hands its buffer over."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        buffer, self._buffer = self._buffer, None
        return buffer

    def local_values(self):
        """The gathered local tensors, each in its own storage; not kept here,
        or they would outlive the `DTensor`s `fsdp` frees after the call."""
        buffer = self.wait()
        if len(self.layouts) == 1 and self.layouts[0].is_whole_buffer():
            # The buffer is the gathered tensor: a copy would raise peak memory.
            return [buffer.view(self.layouts[0].gathered_shape)]
        widths = [layout.numel for layout in self.layouts]
        pieces = buffer.view(self.size, -1).split(widths, dim=1)
        return [layout.joined(p) for layout, p in zip(self.layouts, pieces)]

    def reduce_scatter(self, grads):
        """The shards' gradients (or `None`s) from the gathered values'."""
        results = [None] * len(grads)
        summed = []
        grads = self._summed_over_other_dims(grads)
        for index, (grad, shard, target, layout) in enumerate(
            zip(grads, self.shards, self.placements, self.layouts)
        ):
            if grad is None:
                continue
            if not isinstance(grad, DTensor):
                grad = DTensor.from_local(
                    grad, self.mesh, target, run_check=False
                )
            placement = grad.placements[self.mesh_dim]
            if placement.is_partial() and placement.reduce_op != "sum":
                results[index] = grad.redistribute(
                    self.mesh, shard.placements
                ).to_local()
                continue
            if placement == shard.placements[self.mesh_dim]:
                # Sharded as the weight: each process has its part already.
                results[index] = grad.redistribute(
                    self.mesh, shard.placements
                ).to_local()
                continue
            wanted = list(target)
            if placement.is_partial() or placement.is_replicate():
                wanted[self.mesh_dim] = placement
            if tuple(grad.placements) != tuple(wanted):
                grad = grad.redistribute(self.mesh, wanted)
            local = grad.to_local()
            if wanted[self.mesh_dim].is_partial():
                summed.append((index, layout, local))
            else:
                results[index] = layout.own_part(local, self.coordinate)
        if summed:
            if len(summed) == 1 and summed[0][1].is_whole_buffer():
                # Parts are rows in order: the gradient is the flat tensor.
                pieces = [summed[0][2].reshape(-1)]
            else:
                parts = [
                    layout.padded_parts(local) for _, layout, local in summed
                ]
                pieces = [
                    part[rank].reshape(-1)
                    for rank in range(self.size)
                    for part in parts
                ]
            send = _concatenated(pieces)
            received = send.new_empty(send.numel() // self.size)
            runtime.reduce_scatter_flat(received, send, group=self.group)
            flats = received.split([layout.numel for _, layout, _ in summed])
            for (index, layout, _), flat in zip(summed, flats):
                results[index] = layout.unpadded(flat, self.coordinate)
        return [
            None
            if grad is None
            else DTensor.from_local(
                grad,
                shard.device_mesh,
                shard.placements,
                run_check=False,
                shape=shard.shape,
                stride=shard.stride(),
            )
            for grad, shard in zip(results, self.shards)
        ]

    def _summed_over_other_dims(self, grads):
        """`grads` with partial sums along other mesh dims (weight replicated
        there) summed, in the step's gradient buckets."""
        grads = list(grads)
        indices, parts = [], []
        for index, (grad, target) in enumerate(zip(grads, self.placements)):
            if not isinstance(grad, DTensor):
                continue
            summed = tuple(
                p
                if dim != self.mesh_dim
                and p.is_partial()
                and p.reduce_op == "sum"
                and target[dim].is_replicate()
                else Replicate()
                for dim, p in enumerate(grad.placements)
            )
            if gradients.partial_dims(self.mesh, summed):
                indices.append(index)
                parts.append((grad.to_local(), self.mesh, summed))
        for index, local, (_, _, summed) in zip(
            indices, gradients.reduce_parts(parts), parts
        ):
            grad = grads[index]
            placements = [
                Replicate() if p.is_partial() else q
                for p, q in zip(summed, grad.placements)
            ]
            grads[index] = DTensor.from_local(
                local,
                self.mesh,
                placements,
                run_check=False,
                shape=grad.shape,
                stride=layouts.contiguous_strides(grad.shape),
            )
        return grads


def _concatenated(pieces):
    """`pieces` end to end; a single piece is not copied, to spare memory."""
    return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces)


class _ShardLayout:
    """Where each process' shard lies along a weight's sharded tensor dim."""

    def __init__(self, shard, mesh_dim, size):
        self.dim = shard.placements[mesh_dim].dim
        length = shard.shape[self.dim]
        self.chunk = math.ceil(length / size)
        self.lengths = [
            max(0, min(self.chunk, length - rank * self.chunk))
            for rank in range(size)
        ]
        padded = list(shard.to_local().shape)
        padded[self.dim] = self.chunk
        self.padded_shape = padded
        self.numel = math.prod(padded)
        self.gathered_shape = list(padded)
        self.gathered_shape[self.dim] = length

    def is_whole_buffer(self):
        """Whether it is sharded on dim 0 unpadded: the buffer is the tensor."""
        return self.dim == 0 and all(n == self.chunk for n in self.lengths)

    def padded(self, local):
        """`local` (a shard) padded with zeros to the largest shard."""
        missing = self.chunk - local.shape[self.dim]
        if missing == 0:
            return local
        shape = list(local.shape)
        shape[self.dim] = missing
        return torch.cat([local, local.new_zeros(shape)], dim=self.dim)

    def joined(self, pieces):
        """The gathered tensor from `pieces`' rows, each a flat padded shard."""
        parts = [
            row.view(self.padded_shape).narrow(self.dim, 0, length)
            for row, length in zip(pieces, self.lengths)
        ]
        return torch.cat(parts, dim=self.dim)

    def padded_parts(self, local):
        """`local` (a gathered tensor) split per process, each part padded."""
        parts = torch.split(local, self.lengths, dim=self.dim)
        return [self.padded(part) for part in parts]

    def own_part(self, local, coordinate):
        """This process' part of `local`, in a storage of its own."""
        start = sum(self.lengths[:coordinate])
        return local.narrow(self.dim, start, self.lengths[coordinate]).clone()

    def unpadded(self, flat, coordinate):
        """This process' shard from its flat padded form."""
        return flat.view(self.padded_shape).narrow(
            self.dim, 0, self.lengths[coordinate]
        )


class _GatherFunction(torch.autograd.Function):
    """The gathered values of a `_FlatGather`, reduce-scattering backward."""

    @staticmethod
    def forward(ctx, flat_gather, *shards):
        # Unreached gradients stay `None`: an optimizer skips those, not 0s.
        ctx.set_materialize_grads(False)
        ctx.flat_gather = flat_gather
        return tuple(
            DTensor.from_local(
                local,
                shard.device_mesh,
                target,
                run_check=False,
                shape=shard.shape,
                stride=shard.stride(),
            )
            for local, shard, target in zip(
                flat_gather.local_values(),
                flat_gather.shards,
                flat_gather.placements,
            )
        )

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.flat_gather.reduce_scatter(grads))
