"""One all-gather for all the weights of a layer call, as FSDP2 (`redistribute`
costs 2-3 per weight): shards (`torch.chunk`'s) padded to the largest, one flat
buffer per dtype; partial-sum gradients take one reduce-scatter."""

import math

import torch

from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard
from keras.src.backend.torch.distributed.training import gradients


class PendingGather:
    """Started gathers of `shards` to `placements`: flat (`_FlatGather`) per
    mesh, mesh dim and dtype where possible, else by `redistribute`."""

    def __init__(self, shards, placements, async_op=False):
        self._count, self._alone, grouped = len(shards), {}, {}
        for index, (shard, target) in enumerate(zip(shards, placements)):
            mesh_dim = _flat_mesh_dim(shard, target)
            if mesh_dim is not None:
                key = (shard.device_mesh, mesh_dim, shard.dtype)
                grouped.setdefault(key, []).append((index, shard, target))
                continue
            if async_op and shard.requires_grad and torch.is_grad_enabled():
                # Backward, an async reduce-scatter holds its whole input
                # until waited for: the optimizer would see whole gradients.
                shard = shard.view_as(shard)
                shard.register_hook(_completed_gradient)
            self._alone[index] = shard.redistribute(
                shard.device_mesh, target, async_op=async_op
            )
        self._groups = [
            _FlatGather(*zip(*members), mesh_dim, async_op)
            for (_, mesh_dim, _), members in grouped.items()
        ]

    def values(self):
        """The gathered `DTensor`s; their gradients reduce-scatter to shards."""
        return self._joined(
            dict(self._alone), lambda g: _GatherFunction.apply(g, *g.shards)
        )

    def local_values(self):
        """The gathered local tensors (no autograd history), one per shard."""
        alone = {i: local_tensor(v) for i, v in self._alone.items()}
        return self._joined(alone, _FlatGather.local_values)

    def _joined(self, values, group_values):
        for group in self._groups:
            values.update(zip(group.indices, group_values(group)))
        return [values[i] for i in range(self._count)]

    def wait(self):
        """Waits for the collectives to complete, dropping their results."""
        for value in self._alone.values():
            local_tensor(value)
        for group in self._groups:
            group.wait()
        self._alone, self._groups = {}, []


gather = PendingGather


def _flat_mesh_dim(shard, target):
    """The mesh dim along which a flat buffer gathers `shard` (its only
    change: a plain `Shard`, not nested, to `Replicate`), or `None`."""
    placements = shard.placements
    changed = [dim for dim, p in enumerate(target) if p != placements[dim]]
    if len(changed) != 1:
        return None
    (mesh_dim,) = changed
    placement = placements[mesh_dim]
    if type(placement) is not Shard or not target[mesh_dim].is_replicate():
        return None
    others = [p for dim, p in enumerate(placements) if dim != mesh_dim]
    return None if any(p.is_shard(placement.dim) for p in others) else mesh_dim


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
    return _like(local, grad, grad.placements)


def _like(local, shard, placements, stride=None):
    """A `DTensor` of `local` to `placements`, as global as `shard`."""
    stride = shard.stride() if stride is None else stride
    return layouts.dtensor_from_local(
        local, shard.device_mesh, placements, shard.shape, stride
    )


class _FlatGather:
    """One all-gather of shards along a mesh dim; reduce-scatters gradients."""

    def __init__(self, indices, shards, placements, mesh_dim, async_op):
        self.indices, self.shards, self.placements = indices, shards, placements
        self.mesh = mesh = shards[0].device_mesh
        self.mesh_dim, self.coordinate = mesh_dim, mesh.get_local_rank(mesh_dim)
        self.group, self.size = mesh.get_group(mesh_dim), mesh.size(mesh_dim)
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
        results, summed = [None] * len(grads), []
        grads = self._summed_over_other_dims(grads)
        for index, (grad, shard, target, layout) in enumerate(
            zip(grads, self.shards, self.placements, self.layouts)
        ):
            if grad is None:
                continue
            if not isinstance(grad, DTensor):
                grad = layouts.dtensor_from_local(grad, self.mesh, target)
            placement = grad.placements[self.mesh_dim]
            # A non-sum partial, or sharded as the weight (each has its part).
            if (
                placement.is_partial() and placement.reduce_op != "sum"
            ) or placement == shard.placements[self.mesh_dim]:
                results[index] = grad.redistribute(
                    self.mesh, shard.placements
                ).to_local()
                continue
            wanted = list(target)
            if placement.is_partial():
                wanted[self.mesh_dim] = placement
            if tuple(grad.placements) != tuple(wanted):
                grad = grad.redistribute(self.mesh, wanted)
            if placement.is_partial():
                summed.append((index, layout, grad.to_local()))
            else:
                parts = grad.to_local().split(layout.lengths, layout.dim)
                results[index] = parts[self.coordinate].clone()  # Own storage.
        if summed:
            if len(summed) == 1 and summed[0][1].is_whole_buffer():
                # Parts are rows in order: the gradient is the flat tensor.
                pieces = [summed[0][2].reshape(-1)]
            else:
                parts = [layout.padded_parts(x) for _, layout, x in summed]
                pieces = [
                    p[r].reshape(-1) for r in range(self.size) for p in parts
                ]
            send = _concatenated(pieces)
            received = send.new_empty(send.numel() // self.size)
            runtime.reduce_scatter_flat(received, send, group=self.group)
            flats = received.split([layout.numel for _, layout, _ in summed])
            for (index, layout, _), flat in zip(summed, flats):
                results[index] = flat.view(layout.padded_shape).narrow(
                    layout.dim, 0, layout.lengths[self.coordinate]
                )
        return [
            None if grad is None else _like(grad, shard, shard.placements)
            for grad, shard in zip(results, self.shards)
        ]

    def _summed_over_other_dims(self, grads):
        """`grads` with partial sums along other mesh dims (weight replicated
        there) summed, in the step's gradient buckets."""
        grads, indices, parts = list(grads), [], []
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
            stride = layouts.contiguous_strides(grad.shape)
            grads[index] = _like(local, grad, placements, stride)
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
        self.padded_shape = list(shard.to_local().shape)
        self.padded_shape[self.dim] = self.chunk
        self.numel = math.prod(self.padded_shape)
        self.gathered_shape = list(self.padded_shape)
        self.gathered_shape[self.dim] = length

    def is_whole_buffer(self):
        """Whether it is sharded on dim 0 unpadded: the buffer is the tensor."""
        return self.dim == 0 and all(n == self.chunk for n in self.lengths)

    def padded(self, local):
        """`local` (a shard) padded with zeros to the largest shard."""
        missing = self.chunk - local.shape[self.dim]
        pad = (0, 0) * (local.ndim - 1 - self.dim) + (0, missing)
        return local if missing == 0 else torch.nn.functional.pad(local, pad)

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


class _GatherFunction(torch.autograd.Function):
    """The gathered values of a `_FlatGather`, reduce-scattering backward."""

    @staticmethod
    def forward(ctx, flat_gather, *shards):
        ctx.set_materialize_grads(False)  # Unreached: `None` (skipped), not 0s.
        ctx.flat_gather = flat_gather
        values, targets = flat_gather.local_values(), flat_gather.placements
        return tuple(map(_like, values, shards, targets))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.flat_gather.reduce_scatter(grads))
