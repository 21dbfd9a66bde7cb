"""What a step costs besides time: collectives and per-rank state bytes,
counted and ideal.

`count_collectives` counts with `CommDebugMode`; the counts that need more
than that live with their runners (`keras_runners.keras_collectives`,
`native_runners.ddp_collectives`).
"""

import re

from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import keras

# DDP's default bucket size; Keras buckets its gradient all-reduce alike.
DDP_BUCKET_BYTES = 25 * 1024 * 1024
MIB = 1024 * 1024


# ------------------------------------------------------------ collectives


def count_collectives(fn, roots=()):
    """Collectives `fn()` issues, counted by `CommDebugMode`.

    Args:
        fn: runs the work to count.
        roots: modules (Keras models included) `fn` calls.

    Returns:
        {"total", "forward", "backward", "ops": {op name: count}}.
    """
    mode = CommDebugMode()
    try:
        with mode:
            fn()
    finally:
        _remove_tracker_hooks(mode, roots)
    by_pass = mode.comm_module_counts.get("Global", {})
    return {
        "total": mode.get_total_counts(),
        "forward": sum(by_pass.get("forward", {}).values()),
        "backward": sum(by_pass.get("backward", {}).values()),
        "ops": {
            str(op).split("'")[1] if "'" in str(op) else str(op): n
            for op, n in mode.get_comm_counts().items()
        },
    }


def _remove_tracker_hooks(mode, roots):
    """Removes forward hooks `CommDebugMode` left on modules.

    Its module tracker keeps one hook handle per module *name*; modules
    that share a name (Keras layers that are not registered children get
    their class name) leave hooks behind that fail on the next call.
    """
    tracker = mode.advanced_module_tracker
    for module in _all_modules(roots):
        for key, hook in list(module._forward_hooks.items()):
            if getattr(hook, "__self__", None) is tracker:
                del module._forward_hooks[key]


def _all_modules(roots):
    seen = {}
    for root in roots:
        modules = list(root.modules())
        if isinstance(root, keras.layers.Layer):
            modules += list(
                root._flatten_layers(include_self=True, recursive=True)
            )
        for m in modules:
            if isinstance(m, nn.Module):
                seen[id(m)] = m
    return seen.values()


def ideal_collectives(kind, impl, ref):
    """Ideal collectives of one training step.

    Megatron tensor parallelism: one all-reduce per block in the forward
    pass (after the row-parallel layer), and one in the backward pass (the
    gradient of the column-parallel layer's input) where that input needs a
    gradient. The MLP's input is data: 1. The transformer's two sub-blocks
    start with a LayerNorm whose weights need the gradient of its output:
    2 forward + 2 backward = 4. Data parallelism: one all-reduce per bucket
    of gradients, in DDP's default sizes (`native_ddp`'s, and Keras
    `DataParallel`'s): in reverse order, the first bucket 1 MiB, then
    25 MiB. A rank training alone: none.
    """
    if "_local_" in impl:
        return 0
    if impl.startswith(("keras_mp", "native_tp")):
        return 1 if kind == "mlp" else 4
    return _overlapped_buckets([v.nbytes for v in ref.values()])


def _overlapped_buckets(sizes):
    """Buckets of `sizes` in reverse order, the first of 1 MiB at least."""
    count, size = 0, 0
    for nbytes in reversed(sizes):
        size += nbytes
        if size >= (DDP_BUCKET_BYTES if count else MIB):
            count, size = count + 1, 0
    return count + (1 if size else 0)


# ------------------------------------------------------------ state bytes


def local_bytes(tensors):
    """Bytes this rank holds of `tensors` (local shards of DTensors)."""
    total, seen = 0, set()
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        if isinstance(t, DTensor):
            t = t.to_local()
        total += t.numel() * t.element_size()
    return total


def ideal_state_bytes(ref, layouts, tensor_parallel, world_size):
    """Ideal per-rank bytes of weights + Adam's two moments.

    Sharded weights count 1/N, replicated ones in full; Adam's scalar step
    counters are left out.
    """
    total = 0
    for path, value in ref.items():
        sharded = tensor_parallel and any(
            _fullmatch(key, path) for key in layouts
        )
        total += value.nbytes / world_size if sharded else value.nbytes
    return int(3 * total)


def _fullmatch(pattern, path):
    return re.fullmatch(pattern, path) is not None
