"""Ops DTensor cannot compute as wanted, run on gathered global values, the
results laid out again or written back; counted for `sharding_summary`."""

import dataclasses
import functools
import threading

import torch

from keras.src.backend.torch.distributed.core import layouts
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
    """`func`'s results on its operands' global values, laid out again, and
    `mutated` operands written back into their shards; counted as `name`.
    `differentiable`: autograd records the gathers (a torch function)."""
    operands = [x for x in leaves((args, kwargs)) if isinstance(x, DTensor)]
    mesh, gathered = operands[0].device_mesh, {}
    for x in operands:
        if id(x) in gathered:
            continue
        whole = x.full_tensor() if differentiable else gathered_at_once(x)
        if whole is None:
            # Nothing is recorded below autograd; older DTensor releases
            # refuse the `detach_` a requires-grad gather ends in.
            whole = x.detach().full_tensor()
        # Contiguous for a view (it takes every view a plain tensor takes),
        # else in `x`'s memory order (cuDNN's batch-first RNN backward).
        dims = list(range(x.dim()))
        order = sorted(dims, key=lambda d: (-x.stride(d), d))
        broadcast = any(x.stride(d) == 0 and x.size(d) > 1 for d in dims)
        if _aliasing(func)[0] or broadcast or order == dims:
            gathered[id(x)] = whole.contiguous()
        else:
            inverse = [order.index(d) for d in dims]
            gathered[id(x)] = whole.permute(order).contiguous().permute(inverse)
    global_args, global_kwargs = map_leaves(
        lambda x: gathered[id(x)] if isinstance(x, DTensor) else x,
        (args, kwargs),
    )
    try:
        outputs = func(*global_args, **global_kwargs)
    except Exception as e:
        # It fails on plain tensors too: its own error, DTensor's as context
        # (a refusal that is a reason, not an error, adds none).
        raise e from (refusal if isinstance(refusal, BaseException) else None)
    count(name, refusal, operands)
    for operand in (x for x in mutated if isinstance(x, DTensor)):
        # `value / n` into a partial sum over `n` (no redistributing to it).
        own_mesh = operand.device_mesh
        local = _laid_out(gathered[id(operand)], own_mesh, [operand]).to_local()
        for mesh_dim, placement in enumerate(operand.placements):
            if placement.is_partial() and placement.reduce_op == "sum":
                local = local / own_mesh.size(mesh_dim)
        with torch.no_grad():
            operand.to_local().copy_(local)
    if mutated and len(mutated) == len(leaves(outputs)):
        # An in-place op returns the operands it wrote into.
        return mutated[0] if len(mutated) == 1 else tuple(mutated)
    return map_leaves(lambda y: _laid_out(y, mesh, operands), outputs)


def gathered_at_once(x):
    """`x`'s global value in one all-gather, not `full_tensor`'s one per
    mesh dim; `None` unless plainly sharded on several dims of a world mesh."""
    mesh, placements = x.device_mesh, x.placements
    plain = all(p.is_replicate() or type(p) is Shard for p in placements)
    split = [i for i, p in enumerate(placements) if p.is_shard()]
    split = [i for i in split if mesh.size(i) > 1]
    if not plain or len(split) < 2 or mesh.size() != runtime.world_size():
        return None
    # DTensor shards as `torch.chunk`: the first part is the largest.
    first = layouts.local_region(x.shape, mesh, placements, [0] * mesh.ndim)
    padded = [s.stop - s.start for s in first]
    local = x.to_local()
    send = local.new_zeros(padded)
    send[tuple(slice(0, n) for n in local.shape)] = local
    received = send.new_empty((mesh.size(),) + tuple(padded))
    runtime.all_gather_flat(received.view(-1), send.reshape(-1))
    whole = local.new_empty(x.shape)
    for rank in range(mesh.size()):
        coordinate = (mesh.mesh == rank).nonzero()[0].tolist()
        region = layouts.local_region(x.shape, mesh, placements, coordinate)
        part = tuple(slice(0, s.stop - s.start) for s in region)
        whole[region] = received[rank][part]
    return whole


def _laid_out(value, mesh, operands):
    """`value` laid out like the first same-shape operand, partials reduced."""
    if not isinstance(value, torch.Tensor):
        return value
    whole = [Replicate()] * mesh.ndim
    like = [x for x in operands if x.shape == value.shape]
    like = [x.placements for x in like if x.device_mesh == mesh] + [whole]
    placements = [Replicate() if p.is_partial() else p for p in like[0]]
    replicated = DTensor.from_local(value, mesh, whole, run_check=False)
    return layouts.redistribute(replicated, mesh, placements)


@functools.lru_cache(maxsize=None)
def _aliasing(func):
    """Whether op `func` returns a view of an operand, and `(position, name)`
    of each argument it writes into."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False, ()
    view = any(
        r.alias_info is not None and not r.alias_info.is_write
        for r in schema.returns
    )
    written = tuple(
        (i, argument.name)
        for i, argument in enumerate(schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )
    return view, written


def mutated_operands(func, args, kwargs):
    """The tensor arguments that `func` writes into."""
    return [
        x
        for i, name in _aliasing(func)[1]
        for x in leaves(args[i] if i < len(args) else kwargs.get(name))
        if torch.is_tensor(x)
    ]


def count(name, refusal, operands, gathered_bytes=0):
    """Counts a fallback of `name`: first `refusal`, bytes gathered (those of
    `operands`' global values this process does not hold)."""
    for x in operands:
        partial = any(p.is_partial() for p in x.placements)
        held = 0 if partial else x.to_local().numel()
        gathered_bytes += (x.numel() - held) * x.element_size()
    with _counts_lock:
        entry = _counts.setdefault(name, FallbackCount())
        entry.calls += 1
        entry.gathered_bytes += gathered_bytes
        if entry.calls == 1:
            entry.reason = refusal
            if refusal is None:
                entry.reason = "a plain tensor updated in place with a DTensor"
            elif not isinstance(refusal, str):
                text = " ".join(str(refusal).split())[:200]
                entry.reason = f"{type(refusal).__name__}: {text}"
            message = "fallback: %s (%s), gathering %d bytes"
            runtime.log_debug(message, name, entry.reason, gathered_bytes)


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
