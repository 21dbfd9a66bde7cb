"""Collectives over a named mesh axis, like `jax.lax.psum` / `all_gather`:
every process along the axis calls them, and each gets the result."""

import torch
import torch.distributed as dist

from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor

_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


def all_reduce(x, op="sum", axis_name="model"):
    """Reduces `x` over one mesh axis, as a plain `torch.Tensor`.

    Args:
        x: a tensor (a `DTensor` contributes its local shard).
        op: `"sum"`, `"mean"`, `"max"` or `"min"`.
        axis_name: name of the mesh axis of the current distribution.
    """
    if op not in _REDUCE_OPS:
        raise ValueError(
            f"`op` must be one of {sorted(_REDUCE_OPS)}. Received: op={op}"
        )
    group = _axis_group(axis_name)
    result = as_local_tensor(x).clone()
    dist.all_reduce(result, getattr(dist.ReduceOp, _REDUCE_OPS[op]), group)
    if op == "mean":
        result = result / dist.get_world_size(group)
    return result


def all_gather(x, axis=0, axis_name="model"):
    """Concatenates `x` over one mesh axis in mesh order, as a plain tensor,
    like `jax.lax.all_gather(..., tiled=True)`; parts may differ in size along
    `axis` (padded for the exchange, then cut back).

    Args:
        x: a tensor (a `DTensor` contributes its local shard).
        axis: the tensor dimension to concatenate on.
        axis_name: name of the mesh axis of the current distribution.
    """
    group = _axis_group(axis_name)
    x = as_local_tensor(x)
    axis = axis % x.ndim
    ndims = [n for (n,) in all_gather_ints([x.ndim], group)]
    if len(set(ndims)) > 1:
        raise ValueError(
            f"`all_gather` needs tensors of the same rank on all processes. "
            f"Received ranks {ndims}."
        )
    shapes = [tuple(shape) for shape in all_gather_ints(x.shape, group)]
    if len({s[:axis] + s[axis + 1 :] for s in shapes}) > 1:
        raise ValueError(
            f"`all_gather` along axis {axis} needs the same size in every "
            f"other dimension on all processes. Received shapes {shapes}."
        )
    sizes = [s[axis] for s in shapes]
    pad = [0, 0] * (x.ndim - axis - 1) + [0, max(sizes) - x.shape[axis]]
    padded = torch.nn.functional.pad(x, pad).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(axis, 0, n) for p, n in zip(parts, sizes)], axis)


def all_gather_ints(values, group):
    """A list of ints from each process of `group`, in group order."""
    ints = [int(v) for v in values]
    local = torch.tensor(ints, dtype=torch.int64, device=runtime.comm_device())
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return [p.tolist() for p in parts]


def any_process(flag, group):
    """Whether `flag` is true on any process of `group` (one all-reduce)."""
    value = torch.tensor(
        [1 if flag else 0], dtype=torch.int32, device=runtime.comm_device()
    )
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def as_local_tensor(x):
    """This process' own data of `x`, on the Keras device, as a tensor."""
    if isinstance(x, DTensor):
        return x.to_local()
    return torch.as_tensor(x, device=runtime.backend_core().get_device())


def _axis_group(axis_name):
    """The process group of mesh axis `axis_name` of the distribution."""
    distribution = runtime.current_distribution()
    if distribution is None:
        raise ValueError(
            "Collectives over a mesh axis need a distribution. Call "
            "`keras.distribution.set_distribution(...)` first."
        )
    mesh = distribution.device_mesh
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"Unknown mesh axis '{axis_name}'. The device mesh has axes "
            f"{tuple(mesh.axis_names)}."
        )
    return mesh.backend_mesh.get_group(axis_name)
