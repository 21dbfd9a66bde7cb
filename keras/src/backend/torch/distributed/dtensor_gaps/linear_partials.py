"""Ops linear in an operand, run on each term of its partial sums with no
collective. DTensor reduces partial sums first for the backward of `softmax`
and `log_softmax`, for `scatter` (a mixture-of-experts router's gradient),
and for a partial sum plus a shard over the same axis (`_sum_with_shards`).
"""

import torch

from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Partial
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard

_aten = torch.ops.aten

# op -> (positions of the operands it is linear in, position of its `dim`).
_LINEAR_OPERANDS = {
    # grad_input = output * (grad - sum(grad * output, dim))
    _aten._softmax_backward_data.default: ((0,), 2),
    # grad_input = grad - exp(output) * sum(grad, dim)
    _aten._log_softmax_backward_data.default: ((0,), 2),
    # `self` where `index` does not point, `src` where it does: the backward
    # of `topk`, `max`, `sort`.
    _aten.scatter.src: ((0, 3), 1),
}
# Partial sum + shard; + a replicated value stays DTensor's (reduced first).
_ADD = _aten.add.Tensor

# Given an index twice, these keep one value, which must be the same on each
# process: CPU writes in index order, CUDA only with deterministic algorithms.
_ONE_OF_DUPLICATES = (_aten.scatter.src,)


def on_partial_sums(func, args, kwargs):
    """Aten op `func` on its partial-sum operands' terms, as a partial sum;
    `None` where `func` is not listed or its operands do not allow it."""
    # Called for every op on `DTensor`s: the cheap lookup first.
    entry = _LINEAR_OPERANDS.get(func)
    if entry is None and func is not _ADD:
        return None
    if kwargs or torch.compiler.is_compiling():
        return None
    if func is _ADD:
        return _sum_with_shards(args)
    linear, dim_position = entry
    in_order = args[0].device.type == "cpu"
    if func in _ONE_OF_DUPLICATES and not (
        in_order or torch.are_deterministic_algorithms_enabled()
    ):
        return None
    operands = [(i, x) for i, x in enumerate(args) if isinstance(x, DTensor)]
    if not all(isinstance(args[i], DTensor) for i in linear):
        return None
    mesh = args[linear[0]].device_mesh
    if any(x.device_mesh != mesh for _, x in operands):
        return None
    partial_axes = [
        axis
        for axis in range(mesh.ndim)
        if any(args[i].placements[axis].is_partial() for i in linear)
    ]
    if not partial_axes:
        return None
    dim = args[dim_position] % args[linear[0]].ndim
    placements = _result_placements(
        operands, linear, partial_axes, dim, mesh.ndim
    )
    if placements is None:
        return None
    local_args = list(args)
    for i, x in operands:
        local = _laid_out_as(x, placements, partial_axes).to_local()
        if i in linear:
            local = _as_term(local, x.placements, partial_axes, mesh)
        local_args[i] = local
    result = func(*local_args)
    return layouts.dtensor_from_local(
        result, mesh, placements, shape=args[linear[0]].shape
    )


def _result_placements(operands, linear, partial_axes, dim, ndim):
    """The result's placements, or `None` if the op can't run on locals."""
    placements = []
    for axis in range(ndim):
        if axis in partial_axes:
            if not all(
                x.placements[axis].is_replicate()
                or (i in linear and x.placements[axis] == Partial("sum"))
                for i, x in operands
            ):
                return None
            placements.append(Partial("sum"))
            continue
        shards = {x.placements[axis] for _, x in operands} - {Replicate()}
        if len(shards) > 1:
            return None
        if not shards:
            placements.append(Replicate())
            continue
        shard = shards.pop()
        reference = operands[0][1]
        # Not a strided shard: its chunks are not `torch.chunk`'s.
        if type(shard) is not Shard or shard.dim % reference.ndim == dim:
            return None
        for _, x in operands:
            if x.ndim != reference.ndim or (
                x.shape[shard.dim] != reference.shape[shard.dim]
            ):
                return None
        placements.append(shard)
    return placements


def _laid_out_as(x, placements, partial_axes):
    """`x` split as `placements` off `partial_axes` (a local chunk)."""
    target = [
        p if axis not in partial_axes else x.placements[axis]
        for axis, p in enumerate(placements)
    ]
    if target == list(x.placements):
        return x
    return x.redistribute(x.device_mesh, target)


def _as_term(local, placements, partial_axes, mesh):
    """A replicated operand's term of a partial sum: zeros off first ranks."""
    for axis in partial_axes:
        if placements[axis].is_replicate() and mesh.get_local_rank(axis):
            return torch.zeros_like(local)
    return local


def _sum_with_shards(args):
    """`a + b` of a partial sum and a shard over one axis, or `None`."""
    a, b = args[:2]
    if not (
        isinstance(a, DTensor)
        and isinstance(b, DTensor)
        and a.device_mesh == b.device_mesh
        and a.shape == b.shape
    ):
        return None
    mesh = a.device_mesh
    placements = []
    split = False
    for axis in range(mesh.ndim):
        pa, pb = a.placements[axis], b.placements[axis]
        if pa.is_partial() or pb.is_partial():
            for x in (a, b):
                # Not an average: a shard's chunk in zeros is its term of
                # a sum, of an average a fraction.
                if not (
                    x.placements[axis] == Partial("sum") or _sole_split(x, axis)
                ):
                    return None
            split = split or not (pa.is_partial() and pb.is_partial())
            placements.append(Partial("sum"))
        elif pa == pb:
            placements.append(pa)
        else:
            return None
    if not split:
        return None
    terms = [_shard_as_term(x, placements, mesh) for x in (a, b)]
    return layouts.dtensor_from_local(
        terms[0] + terms[1], mesh, placements, shape=a.shape
    )


def _sole_split(x, axis):
    """Whether `x` is sharded over `axis` on a dim no other mesh axis shards."""
    p = x.placements[axis]
    return type(p) is Shard and not any(
        q.is_shard() and q.dim % x.ndim == p.dim % x.ndim
        for other, q in enumerate(x.placements)
        if other != axis
    )


def _shard_as_term(x, placements, mesh):
    """`x`'s local term of a partial sum: a shard on a partial axis in 0s."""
    local = x.to_local()
    for axis, target in enumerate(placements):
        p = x.placements[axis]
        if not (target.is_partial() and p.is_shard()):
            continue
        dim = p.dim % x.ndim
        shape = list(local.shape)
        shape[dim] = x.shape[dim]
        start, stop = layouts.chunk_bounds(
            x.shape[dim], mesh.size(axis), mesh.get_local_rank(axis)
        )
        term = local.new_zeros(shape)
        term.narrow(dim, start, stop - start).copy_(local)
        local = term
    return local
