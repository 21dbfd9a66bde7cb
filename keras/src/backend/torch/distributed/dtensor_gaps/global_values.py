"""Ops DTensor cannot compute as wanted, run on gathered global values, the
results laid out again or written back; counted for `sharding_summary`."""

import dataclasses
import functools
import threading

import torch

from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard


@dataclasses.dataclass
class FallbackCount:
    """An op's fallback `calls`, bytes gathered, and DTensor's first error."""

    calls: int = 0
    gathered_bytes: int = 0
    reason: str = ""


_counts = {}
_counts_lock = threading.Lock()


def fallback_counts():
    """`{op name: copy of its FallbackCount}` of ops run on global values."""
    with _counts_lock:
        return {k: dataclasses.replace(v) for k, v in _counts.items()}


def reset_fallback_counts():
    """Forgets the ops counted by `fallback_counts`."""
    with _counts_lock:
        _counts.clear()


def on_global_values(
    func, args, kwargs, refusal, name, mutated=(), differentiable=False
):
    """`func`'s results on its operands' global values, laid out again;
    `mutated` operands are written back, counted under `name`.
    `differentiable`: autograd records the gathers (a torch function)."""
    operands = [x for x in leaves((args, kwargs)) if isinstance(x, DTensor)]
    mesh = operands[0].device_mesh
    gathered = {}

    def global_value(x):
        if not isinstance(x, DTensor):
            return x
        if id(x) not in gathered:
            if differentiable:
                whole = x.full_tensor()
            else:
                whole = gathered_at_once(x)
                if whole is None:
                    # Nothing is recorded below autograd; torch < 2.13's DTensor
                    # refuses the `detach_` a requires-grad gather ends in.
                    whole = x.detach().full_tensor()
            if _is_view(func):
                # Contiguous, it takes every view one process' tensor takes.
                gathered[id(x)] = whole.contiguous()
            else:
                gathered[id(x)] = _in_memory_order_of(whole, x)
        return gathered[id(x)]

    global_args, global_kwargs = map_leaves(global_value, (args, kwargs))
    try:
        outputs = func(*global_args, **global_kwargs)
    except Exception as e:
        # It fails on plain tensors too: its own error, DTensor's as context.
        raise e from refusal
    count(name, refusal, operands)
    for operand in mutated:
        if isinstance(operand, DTensor):
            _write_back(operand, gathered[id(operand)])
    if mutated and len(mutated) == len(leaves(outputs)):
        # An in-place op returns the operands it wrote into.
        return mutated[0] if len(mutated) == 1 else tuple(mutated)
    return map_leaves(
        lambda y: (
            _laid_out(y, mesh, operands) if isinstance(y, torch.Tensor) else y
        ),
        outputs,
    )


def _in_memory_order_of(whole, x):
    """`whole`, dense, in `x`'s memory order: cuDNN's batch-first RNN
    backward needs its non-contiguous output."""
    order = _memory_order(x)
    if order is None or order == sorted(order):
        return whole.contiguous()
    inverse = [order.index(d) for d in range(len(order))]
    return whole.permute(order).contiguous().permute(inverse)


def _memory_order(x):
    """Dimensions of `x` outermost to innermost in memory (as its local
    tensor's); `None` if broadcast."""
    if any(x.stride(d) == 0 and x.size(d) > 1 for d in range(x.dim())):
        return None
    return sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))


def gathered_at_once(x):
    """`x`'s global value in one all-gather, not `full_tensor`'s one per
    mesh dim; `None` unless plainly sharded on several dims of a world mesh."""
    mesh = x.device_mesh
    placements = x.placements
    if (
        any(not (p.is_replicate() or type(p) is Shard) for p in placements)
        or sum(
            1
            for i, p in enumerate(placements)
            if p.is_shard() and mesh.size(i) > 1
        )
        < 2
    ):
        return None
    if mesh.size() != torch.distributed.get_world_size():
        return None
    shape, mesh_shape = tuple(x.shape), tuple(mesh.shape)
    ranks = mesh.mesh.reshape(-1).tolist()
    coordinates = {
        rank: tuple(
            int(i) for i in torch.unravel_index(torch.tensor(k), mesh_shape)
        )
        for k, rank in enumerate(ranks)
    }
    # DTensor shards as `torch.chunk`: the first part is the largest.
    _, padded = _part_box(shape, placements, mesh_shape, (0,) * mesh.ndim)
    local = x.to_local()
    send = local.new_zeros(padded)
    send[tuple(slice(0, n) for n in local.shape)] = local
    received = send.new_empty(len(ranks) * send.numel())
    runtime.all_gather_flat(received, send.reshape(-1))
    received = received.view((len(ranks),) + tuple(padded))
    whole = local.new_empty(shape)
    for rank in range(len(ranks)):
        start, lengths = _part_box(
            shape, placements, mesh_shape, coordinates[rank]
        )
        whole[tuple(slice(a, a + n) for a, n in zip(start, lengths))] = (
            received[rank][tuple(slice(0, n) for n in lengths)]
        )
    return whole


def _part_box(shape, placements, mesh_shape, coordinate):
    """`(start, lengths)` per dimension of the part at mesh `coordinate`."""
    start, lengths = [0] * len(shape), list(shape)
    for mesh_dim, placement in enumerate(placements):
        if not placement.is_shard():
            continue
        dim = placement.dim % len(shape)
        chunk = -(-lengths[dim] // mesh_shape[mesh_dim])
        low = min(chunk * coordinate[mesh_dim], lengths[dim])
        high = min(low + chunk, lengths[dim])
        start[dim] += low
        lengths[dim] = high - low
    return start, lengths


def _laid_out(value, mesh, operands):
    """`value` laid out like the first same-shape operand (partials reduced)."""
    whole = [Replicate()] * mesh.ndim
    like = [x for x in operands if x.shape == value.shape]
    like = [x.placements for x in like if x.device_mesh == mesh] + [whole]
    placements = [Replicate() if p.is_partial() else p for p in like[0]]
    replicated = DTensor.from_local(value, mesh, whole, run_check=False)
    if all(p.is_replicate() for p in placements):
        return replicated
    return replicated.redistribute(mesh, placements)


def _write_back(operand, value):
    """Writes a global `value` into `operand`'s shards, `value / n` into a
    partial sum over `n` (DTensor does not redistribute to `Partial`)."""
    mesh = operand.device_mesh
    replicated = DTensor.from_local(
        value, mesh, [Replicate()] * mesh.ndim, run_check=False
    )
    sharded = [Replicate() if p.is_partial() else p for p in operand.placements]
    local = replicated.redistribute(mesh, sharded).to_local()
    for mesh_dim, placement in enumerate(operand.placements):
        if placement.is_partial() and placement.reduce_op == "sum":
            local = local / mesh.size(mesh_dim)
    with torch.no_grad():
        operand.to_local().copy_(local)


@functools.lru_cache(maxsize=None)
def _is_view(func):
    """Whether op `func` returns a view of an operand."""
    schema = getattr(func, "_schema", None)
    return schema is not None and any(
        r.alias_info is not None and not r.alias_info.is_write
        for r in schema.returns
    )


def mutated_operands(func, args, kwargs):
    """The tensor arguments that `func` writes into."""
    mutated = []
    for position, name in _written_arguments(func):
        value = args[position] if position < len(args) else kwargs.get(name)
        mutated.extend(x for x in leaves(value) if torch.is_tensor(x))
    return mutated


@functools.lru_cache(maxsize=None)
def _written_arguments(func):
    """`(position, name)` of each argument `func`'s schema writes into."""
    return tuple(
        (i, argument.name)
        for i, argument in enumerate(func._schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


def count(name, refusal, operands, gathered_bytes=0):
    """Counts a fallback of `name`: first `refusal`, bytes gathered."""
    gathered_bytes += sum(_gathered_bytes(x) for x in operands)
    with _counts_lock:
        entry = _counts.setdefault(name, FallbackCount())
        first = entry.calls == 0
        entry.calls += 1
        entry.gathered_bytes += gathered_bytes
        if first:
            entry.reason = _first_line(refusal)
    if first:
        message = "fallback: %s (%s), gathering %d bytes"
        runtime.log_debug(message, name, entry.reason, gathered_bytes)


def _gathered_bytes(x):
    """The bytes of `x`'s global value that this process does not hold."""
    partial = any(p.is_partial() for p in x.placements)
    held = 0 if partial else x.to_local().numel()
    return (x.numel() - held) * x.element_size()


def _first_line(error):
    if error is None:
        return "a plain tensor updated in place with a DTensor"
    if isinstance(error, str):
        return error
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:200]}"


def leaves(value):
    """The leaves of nested lists, tuples and dicts (`torch.Size` included)."""
    if isinstance(value, (list, tuple)):
        return [leaf for x in value for leaf in leaves(x)]
    if isinstance(value, dict):
        return [leaf for x in value.values() for leaf in leaves(x)]
    return [value]


def map_leaves(function, value):
    """`value` with `function` applied to each leaf (a `torch.Size` is one)."""
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        mapped = [map_leaves(function, x) for x in value]
        return type(value)(mapped) if isinstance(value, list) else tuple(mapped)
    if isinstance(value, dict):
        return {k: map_leaves(function, x) for k, x in value.items()}
    return function(value)
