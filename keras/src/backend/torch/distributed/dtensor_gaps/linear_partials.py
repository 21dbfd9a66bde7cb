"""Ops linear in an operand, run on each term of its partial sums with no
collective, where DTensor reduces them first: the backward of `softmax` and
`log_softmax`, `scatter`, and a partial sum plus a shard over one axis."""

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
    # `self` where `index` does not point, `src` where it does (backward of
    # `topk`, `max`, `sort`).
    _aten.scatter.src: ((0, 3), 1),
    # Partial sum + shard (`_sum_with_shards`); + replicated stays DTensor's.
    _aten.add.Tensor: None,
}


def on_partial_sums(func, args, kwargs):
    """Aten op `func` on its partial-sum operands' terms, as a partial sum;
    `None` where `func` is not listed or its operands do not allow it."""
    # Called for every op on `DTensor`s: the cheap lookup first.
    if func not in _LINEAR_OPERANDS or kwargs or torch.compiler.is_compiling():
        return None
    if func is _aten.add.Tensor:
        return _sum_with_shards(args)
    # `scatter` keeps one of an index's values, alike on every process on CPU
    # (in index order), on CUDA only with deterministic algorithms.
    if func is _aten.scatter.src and not (
        args[0].device.type == "cpu"
        or torch.are_deterministic_algorithms_enabled()
    ):
        return None
    linear, dim_position = _LINEAR_OPERANDS[func]
    operands = [(i, x) for i, x in enumerate(args) if isinstance(x, DTensor)]
    if not all(isinstance(args[i], DTensor) for i in linear):
        return None
    mesh = args[linear[0]].device_mesh
    if any(x.device_mesh != mesh for _, x in operands):
        return None
    placements = _result_placements(operands, linear, args[dim_position])
    if placements is None:
        return None
    local_args = list(args)
    for i, x in operands:
        target = [
            x.placements[axis] if p.is_partial() else p
            for axis, p in enumerate(placements)
        ]
        x = layouts.redistribute(x, x.device_mesh, target)
        local_args[i] = x.to_local()
        # A replicated operand's term of a partial sum: zeros off first ranks.
        if i in linear and any(
            p.is_partial() and q.is_replicate() and mesh.get_local_rank(axis)
            for axis, (p, q) in enumerate(zip(placements, x.placements))
        ):
            local_args[i] = torch.zeros_like(local_args[i])
    return layouts.dtensor_from_local(
        func(*local_args), mesh, placements, shape=args[linear[0]].shape
    )


def _result_placements(operands, linear, dim):
    """The result's placements, partial on the mesh axes where a linear operand
    is; `None` if none is or the op (along `dim`) can't run on locals."""
    placements, reference = [], operands[0][1]
    for axis in range(reference.device_mesh.ndim):
        if any(
            i in linear and x.placements[axis].is_partial() for i, x in operands
        ):
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
        (shard,) = shards
        # Not a strided shard: its chunks are not `torch.chunk`'s.
        if type(shard) is not Shard or (shard.dim - dim) % reference.ndim == 0:
            return None
        if any(
            x.ndim != reference.ndim
            or x.shape[shard.dim] != reference.shape[shard.dim]
            for _, x in operands
        ):
            return None
        placements.append(shard)
    return placements if Partial("sum") in placements else None


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
    mesh, placements, split = a.device_mesh, [], False
    for axis in range(mesh.ndim):
        pa, pb = a.placements[axis], b.placements[axis]
        if pa.is_partial() or pb.is_partial():
            # Not an average: a shard's chunk in zeros is its term of a sum,
            # of an average a fraction.
            if not all(
                x.placements[axis] == Partial("sum") or _sole_split(x, axis)
                for x in (a, b)
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
    for axis, (target, p) in enumerate(zip(placements, x.placements)):
        if target.is_partial() and p.is_shard():
            dim = p.dim % x.ndim
            start, stop = layouts.chunk_bounds(
                x.shape[dim], mesh.size(axis), mesh.get_local_rank(axis)
            )
            padding = [0, 0] * (x.ndim - 1 - dim) + [start, x.shape[dim] - stop]
            local = torch.nn.functional.pad(local, padding)
    return local
