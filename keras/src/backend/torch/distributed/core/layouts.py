"""Keras meshes and layouts as torch device meshes and DTensor placements.

A Keras `DeviceMesh` becomes a `torch.distributed.device_mesh.DeviceMesh`
with one device per process, and a `TensorLayout` becomes one DTensor
placement per mesh axis. The sharding rules the other modules share are
written here once: how `torch.chunk` cuts a dimension, and how a DTensor is
built from this process' piece of it.
"""

import collections

import torch
import torch.distributed as dist

from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard
from keras.src.backend.torch.distributed.core.runtime import TorchDeviceMesh
from keras.src.backend.torch.distributed.health import health

TorchLayout = collections.namedtuple(
    "TorchLayout", ["device_mesh", "placements", "ndim"]
)
TorchLayout.__doc__ = """The torch counterpart of a Keras `TensorLayout`.

Attributes:
    device_mesh: the `torch.distributed.device_mesh.DeviceMesh`.
    placements: one DTensor placement per mesh dimension.
    ndim: the number of entries of the layout: it applies to tensors of
        at least this rank, and replicates their dimensions past it.
"""

# (world group, torch device mesh) by (device type, ranks, shape, axis names):
# a 2-D mesh creates process groups, not to be created for every Keras mesh.
_torch_meshes = {}


def to_torch_device(device_name):
    """Returns the global rank that owns a Keras device name.

    Args:
        device_name: `"gpu:i"` or `"cpu:i"` (`i` is the global rank).

    Returns:
        A pair `(device_type, rank)`.
    """
    device_type, _, index = str(device_name).lower().partition(":")
    device_type = "gpu" if device_type == "cuda" else device_type
    if device_type not in ("cpu", "gpu") or not index.isdigit():
        raise ValueError(
            "Devices must be named 'cpu:<rank>' or 'gpu:<rank>', as "
            f"`keras.distribution.list_devices()` names them. Received: "
            f"device='{device_name}'"
        )
    return device_type, int(index)


def to_torch_mesh(device_mesh):
    """Converts a Keras `DeviceMesh` to a torch `DeviceMesh`.

    Dimension names are the Keras axis names, and ranks follow the Keras
    device list (the device `"gpu:i"` is rank `i`). Joins the job's process
    group first if needed.

    Args:
        device_mesh: the `keras.distribution.DeviceMesh`.

    Returns:
        A `torch.distributed.device_mesh.DeviceMesh`.
    """
    runtime.check_torch_version()
    device_type, ranks = _check_mesh(device_mesh)
    if not dist.is_initialized():
        runtime.initialize_job()
    torch_device_type = "cuda" if device_type == "gpu" else "cpu"
    key = (
        torch_device_type,
        tuple(ranks),
        tuple(device_mesh.shape),
        tuple(device_mesh.axis_names),
    )
    world, torch_mesh = _torch_meshes.get(key, (None, None))
    # A mesh belongs to the process group it was made in.
    if world is not dist.group.WORLD:
        torch_mesh = TorchDeviceMesh(
            torch_device_type,
            torch.tensor(ranks).reshape(tuple(device_mesh.shape)),
            mesh_dim_names=tuple(device_mesh.axis_names),
        )
        _torch_meshes[key] = (dist.group.WORLD, torch_mesh)
        # The job's own group keeps its bound until the first step.
        health.bound_groups(
            g for g in torch_mesh.get_all_groups() if g != dist.group.WORLD
        )
        runtime.log_debug(
            "mesh: shape %s, axes %s, ranks %s",
            tuple(device_mesh.shape),
            tuple(device_mesh.axis_names),
            ranks,
        )
    return torch_mesh


def all_process_groups():
    """The job's process group and those of every mesh made in it."""
    groups = {id(dist.group.WORLD): dist.group.WORLD}
    for world, torch_mesh in _torch_meshes.values():
        if world is dist.group.WORLD:
            for group in torch_mesh.get_all_groups():
                groups[id(group)] = group
    return list(groups.values())


def _check_mesh(device_mesh):
    """Checks that a Keras mesh holds each process of the job once.

    Returns:
        `(device_type, ranks)`: `"cpu"` or `"gpu"`, and the mesh's ranks in
        device order.
    """
    devices = device_mesh.devices.flatten().tolist()
    parsed = [to_torch_device(d) for d in devices]
    device_types = sorted({device_type for device_type, _ in parsed})
    ranks = [rank for _, rank in parsed]
    world_size = runtime.world_size()
    if len(device_types) > 1:
        raise ValueError(
            f"A device mesh cannot mix device types. Received devices {devices}"
        )
    if device_types[0] == "gpu" and not torch.cuda.is_available():
        raise ValueError(
            f"The device mesh has GPU devices {devices}, but this process "
            "sees no GPU (torch.cuda.is_available() is False). On a CPU job "
            "use `keras.distribution.list_devices()` (or 'cpu:<rank>' "
            "names), or run on machines with GPUs."
        )
    if sorted(ranks) != list(range(world_size)):
        raise ValueError(
            f"The device mesh must hold every process of the job exactly "
            f"once, one device per process. The mesh has {len(ranks)} "
            f"devices {devices} (shape {tuple(device_mesh.shape)}), but the "
            f"job has {world_size} process(es), i.e. devices "
            f"{runtime.device_names(device_types[0])}. Use "
            "`keras.distribution.list_devices()` for the mesh, or launch "
            f"{len(ranks)} processes (e.g. `torchrun "
            f"--nproc_per_node={len(ranks)} ...`)."
        )
    if len(set(device_mesh.axis_names)) != len(device_mesh.axis_names):
        raise ValueError(
            f"Mesh axis names must be unique. Received: "
            f"axis_names={device_mesh.axis_names}"
        )
    return device_types[0], ranks


def to_torch_layout(tensor_layout):
    """Converts a Keras `TensorLayout` to DTensor placements on a torch mesh.

    Each tensor dimension is sharded over the mesh axes named for it; a
    dimension may name several axes (`("batch", "model")`), which shards it
    over their product in the order `jax.sharding.PartitionSpec` uses (the
    first axis outermost).

    Args:
        tensor_layout: the `keras.distribution.TensorLayout`.

    Returns:
        A `TorchLayout`.
    """
    if tensor_layout.device_mesh is None:
        raise ValueError(
            "Cannot create sharding when device mesh is not set "
            "for TensorLayout."
        )
    axis_names = list(tensor_layout.device_mesh.axis_names)
    placements = [Replicate()] * len(axis_names)
    for tensor_dim, axes in enumerate(tensor_layout.axes):
        axes = axes if isinstance(axes, (tuple, list)) else (axes,)
        axes = [axis for axis in axes if axis is not None]
        mesh_dims = [_mesh_dim(a, axis_names, tensor_layout) for a in axes]
        if mesh_dims != sorted(mesh_dims):
            raise ValueError(
                f"A tensor dimension sharded over several mesh axes must "
                f"name them in mesh order {tuple(axis_names)}. Received: "
                f"{tuple(axes)} for dimension {tensor_dim} of "
                f"{tensor_layout}"
            )
        for mesh_dim in mesh_dims:
            if placements[mesh_dim].is_shard():
                raise ValueError(
                    f"Mesh axis '{axis_names[mesh_dim]}' is used more than "
                    f"once in the layout axes {tensor_layout.axes}. Each "
                    "mesh axis can shard at most one tensor dimension."
                )
            placements[mesh_dim] = Shard(tensor_dim)
    return TorchLayout(
        tensor_layout.device_mesh.backend_mesh,
        tuple(placements),
        len(tensor_layout.axes),
    )


def _mesh_dim(axis_name, axis_names, tensor_layout):
    if axis_name not in axis_names:
        raise ValueError(
            f"Unknown mesh axis '{axis_name}' in the layout axes "
            f"{tensor_layout.axes}. The device mesh has axes "
            f"{tuple(axis_names)}."
        )
    return axis_names.index(axis_name)


def as_torch_layout(layout):
    """Accepts a Keras `TensorLayout` or a `TorchLayout`.

    Returns:
        The `TorchLayout`.
    """
    if isinstance(layout, TorchLayout):
        return layout
    if hasattr(layout, "backend_layout"):
        return layout.backend_layout
    raise ValueError(
        "Expected a `keras.distribution.TensorLayout`. Received: "
        f"layout={layout} (of type {type(layout)})"
    )


def check_rank(x, layout, what):
    """Raises if `layout` has more entries than `x` has dimensions.

    A shorter layout lays out the leading dimensions and replicates the
    trailing ones, as a shorter `jax.sharding.PartitionSpec` does: one
    layer `/output` layout then fits every leaf of the layer's outputs
    (e.g. an LSTM's sequence and states). Its placements need no change:
    `to_torch_layout` shards only dimensions below `layout.ndim`, which
    every tensor of at least that rank has.
    """
    if x.ndim < layout.ndim:
        raise ValueError(
            f"The layout of the {what} has {layout.ndim} axes, but the "
            f"{what} has rank {x.ndim} (shape {tuple(x.shape)}). Give the "
            "layout at most one entry per tensor dimension (dimensions "
            "past the layout's entries are replicated)."
        )


def chunk_bounds(length, num_parts, index):
    """The part `index` of `length` items cut in `num_parts` parts.

    Parts are cut like `torch.chunk` cuts them, which is how DTensor shards
    an uneven dimension: equal parts, a smaller last one, and empty parts at
    the end when there are too few items (5 on 4 parts: 2, 2, 1, 0).

    Returns:
        `(start, stop)`.
    """
    part_size = -(-length // num_parts)
    start = min(index * part_size, length)
    return start, min(start + part_size, length)


def without_empty_shards(shape, mesh, placements):
    """`placements`, a dimension that would leave a process nothing whole.

    DTensor cuts an uneven dimension like `torch.chunk`, which leaves the
    last processes empty parts when there are too few items (one prompt on
    two processes). On an empty part, a reduction without an identity
    (`min`, `max`) fails on those processes alone, and the others wait for
    them in the next collective. Such a dimension is replicated along the
    mesh axes that shard it: the value is the same, each process holds it
    all.

    Args:
        shape: the global shape.
        mesh: the torch `DeviceMesh`.
        placements: one placement per mesh dimension.

    Returns:
        The placements, as a tuple.
    """
    placements = list(placements)
    for dim, length in enumerate(shape):
        mesh_dims = [
            d
            for d, p in enumerate(placements)
            if p.is_shard() and p.dim % len(shape) == dim
        ]
        sizes = {length}
        for mesh_dim in mesh_dims:
            parts = mesh.size(mesh_dim)
            sizes = {
                stop - start
                for size in sizes
                for start, stop in (
                    chunk_bounds(size, parts, i) for i in range(parts)
                )
            }
        if 0 in sizes:
            for mesh_dim in mesh_dims:
                placements[mesh_dim] = Replicate()
    return tuple(placements)


def local_region(shape, mesh, placements):
    """The slices of a global tensor that this process' shard holds.

    Mesh dimensions split in order; a tensor dimension sharded over several
    mesh axes is split again within each part.

    Returns:
        A tuple of one `slice` per tensor dimension.
    """
    coordinate = mesh.get_coordinate()
    bounds = [(0, size) for size in shape]
    for mesh_dim, placement in enumerate(placements):
        if not placement.is_shard():
            continue
        dim = placement.dim % len(shape)
        start, stop = bounds[dim]
        low, high = chunk_bounds(
            stop - start, mesh.size(mesh_dim), coordinate[mesh_dim]
        )
        bounds[dim] = (start + low, start + high)
    return tuple(slice(start, stop) for start, stop in bounds)


def dtensor_from_local(local, mesh, placements, shape=None, stride=None):
    """Builds a `DTensor` from this process' piece, without communication.

    Args:
        local: this process' piece, a plain tensor.
        mesh: the torch device mesh.
        placements: one placement per mesh dimension.
        shape: the global shape; needed whenever pieces can be uneven, since
            DTensor would otherwise assume even pieces (and each process
            would compute another global shape).
        stride: the global stride; defaults to the contiguous one of `shape`.

    Returns:
        A `DTensor`, differentiable with respect to `local`.
    """
    if shape is not None:
        shape = torch.Size(shape)
        if stride is None:
            stride = contiguous_strides(shape)
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=shape, stride=stride
    )


def replicate(x, mesh):
    """A plain tensor taken as the global value, as a replicated `DTensor`.

    Args:
        x: anything; only plain, non-symbolic tensors are converted.
        mesh: the torch device mesh.

    Returns:
        `x`, or the replicated `DTensor`.
    """
    if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or x.is_meta:
        return x
    return dtensor_from_local(x, mesh, [Replicate()] * mesh.ndim)


def redistribute(x, mesh, placements):
    """`x.redistribute(mesh, placements)`, skipped when it changes nothing.

    On a CPU mesh, a mesh axis that shards another dimension afterwards
    is gathered first: DTensor's all-to-all there is an all-gather and a
    chunk anyway (chosen by device type, with a warning on each process).
    """
    if tuple(x.placements) == tuple(placements) and x.device_mesh == mesh:
        return x
    if mesh.device_type == "cpu":
        gathered = [
            Replicate() if p.is_shard() and t.is_shard() and p != t else p
            for p, t in zip(x.placements, placements)
        ]
        if gathered != list(x.placements):
            x = x.redistribute(mesh, gathered)
    return x.redistribute(mesh, placements)


def reduced_placements(placements):
    """`placements` with partial sums (`Partial`) made `Replicate`."""
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def drop_unit_shards(mesh, placements):
    """`placements` with shards over mesh axes of size 1 made `Replicate`.

    A size-1 axis splits nothing, so the value is the same; but a batch
    sharded over it would make every weight gradient `Partial` over it, and
    each such gradient would then need relabeling as reduced.
    """
    return tuple(
        Replicate() if p.is_shard() and mesh.size(d) == 1 else p
        for d, p in enumerate(placements)
    )


def contiguous_strides(shape):
    """The strides of a contiguous tensor of `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
