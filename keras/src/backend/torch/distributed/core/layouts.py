"""Keras meshes and layouts as torch device meshes (one device per process) and
DTensor placements, and the shared sharding rules (`torch.chunk` cuts)."""

from collections import namedtuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard
from keras.src.backend.torch.distributed.health import health

TorchLayout = namedtuple("TorchLayout", "device_mesh placements ndim")
TorchLayout.__doc__ = """The torch counterpart of a Keras `TensorLayout`: a
torch `device_mesh`, one DTensor placement per mesh dimension, and `ndim`, the
number of layout entries (a tensor's dimensions past them are replicated)."""

_torch_meshes = {}  # Cached: a 2-D mesh creates process groups.


def to_torch_device(device_name):
    """Parses a Keras device name `"gpu:i"` as `(device_type, rank)`."""
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
    """Converts a Keras `DeviceMesh` to a torch one, joining the job if needed;
    refuses a mesh not holding each process of the job once."""
    runtime.check_torch_version()
    devices = device_mesh.devices.flatten().tolist()
    device_types, ranks = zip(*(to_torch_device(d) for d in devices))
    if len(set(device_types)) > 1:
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
    world_size = runtime.world_size()
    if sorted(ranks) != list(range(world_size)):
        raise ValueError(
            f"The device mesh must hold every process of the job exactly "
            f"once, one device per process. The mesh has {len(ranks)} "
            f"devices {devices} (shape {tuple(device_mesh.shape)}), but the "
            f"job has {world_size} process(es), i.e. devices "
            f"{[f'{device_types[0]}:{i}' for i in range(world_size)]}. Use "
            "`keras.distribution.list_devices()` for the mesh, or launch "
            f"{len(ranks)} processes (e.g. `torchrun "
            f"--nproc_per_node={len(ranks)} ...`)."
        )
    if len(set(device_mesh.axis_names)) != len(device_mesh.axis_names):
        raise ValueError(
            f"Mesh axis names must be unique. Received: "
            f"axis_names={device_mesh.axis_names}"
        )
    if not dist.is_initialized():
        runtime.initialize_job()
    device_type = "cuda" if device_types[0] == "gpu" else "cpu"
    shape, names = tuple(device_mesh.shape), tuple(device_mesh.axis_names)
    key = (device_type, ranks, shape, names)
    world, torch_mesh = _torch_meshes.get(key, (None, None))
    if world is not dist.group.WORLD:  # A mesh is of the group it was made in.
        grid = torch.tensor(ranks).reshape(shape)
        torch_mesh = DeviceMesh(device_type, grid, mesh_dim_names=names)
        _torch_meshes[key] = (dist.group.WORLD, torch_mesh)
        health.bound_groups(  # WORLD keeps its bound until the first step.
            g for g in torch_mesh.get_all_groups() if g != dist.group.WORLD
        )
        runtime.log_debug(
            "mesh: shape %s, axes %s, ranks %s", shape, names, list(ranks)
        )
    return torch_mesh


def all_process_groups():
    """The job's process group and those of every mesh made in it."""
    groups = {id(dist.group.WORLD): dist.group.WORLD}
    for world, torch_mesh in _torch_meshes.values():
        if world is dist.group.WORLD:
            groups.update((id(g), g) for g in torch_mesh.get_all_groups())
    return list(groups.values())


def to_torch_layout(tensor_layout):
    """Converts a Keras `TensorLayout` to a `TorchLayout`; a dimension naming
    several mesh axes is sharded over their product, first axis outermost."""
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
        for axis in axes:
            if axis not in axis_names:
                raise ValueError(
                    f"Unknown mesh axis '{axis}' in the layout axes "
                    f"{tensor_layout.axes}. The device mesh has axes "
                    f"{tuple(axis_names)}."
                )
        mesh_dims = [axis_names.index(axis) for axis in axes]
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
    mesh = tensor_layout.device_mesh.backend_mesh
    return TorchLayout(mesh, tuple(placements), len(tensor_layout.axes))


def as_torch_layout(layout):
    """Returns the `TorchLayout` of a Keras `TensorLayout` or `TorchLayout`."""
    if isinstance(layout, TorchLayout):
        return layout
    if hasattr(layout, "backend_layout"):
        return layout.backend_layout
    raise ValueError(
        "Expected a `keras.distribution.TensorLayout`. Received: "
        f"layout={layout} (of type {type(layout)})"
    )


def check_rank(x, layout, what):
    """Raises if `layout` has more entries than `x` has dimensions (a shorter
    one replicates the rest, so one `/output` layout fits every output leaf)."""
    if x.ndim < layout.ndim:
        raise ValueError(
            f"The layout of the {what} has {layout.ndim} axes, but the "
            f"{what} has rank {x.ndim} (shape {tuple(x.shape)}). Give the "
            "layout at most one entry per tensor dimension (dimensions "
            "past the layout's entries are replicated)."
        )


def chunk_bounds(length, num_parts, index):
    """Part `index` of `length` items cut in `num_parts` as `torch.chunk`
    (DTensor's uneven sharding) cuts, as `(start, stop)`; may be empty."""
    part_size = -(-length // num_parts)
    start = min(index * part_size, length)
    return start, min(start + part_size, length)


def without_empty_shards(shape, mesh, placements):
    """`placements`, replicating dimensions that would leave a process empty:
    there a reduction without identity (`min`, `max`) fails and others hang."""
    placements = list(placements)
    for dim, length in enumerate(shape):
        on = [p.is_shard() and p.dim % len(shape) == dim for p in placements]
        mesh_dims = [d for d, sharded in enumerate(on) if sharded]
        sizes = {length}
        for mesh_dim in mesh_dims:
            n = mesh.size(mesh_dim)
            bounds = [chunk_bounds(s, n, i) for s in sizes for i in range(n)]
            sizes = {stop - start for start, stop in bounds}
        if 0 in sizes:
            for mesh_dim in mesh_dims:
                placements[mesh_dim] = Replicate()
    return tuple(placements)


def local_region(shape, mesh, placements, coordinate=None):
    """One `slice` per dimension: the global region the shard at `coordinate`
    (default: this process') holds; mesh axes split a dim in mesh order."""
    coordinate = mesh.get_coordinate() if coordinate is None else coordinate
    bounds = [(0, size) for size in shape]
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            dim = placement.dim % len(shape)
            start, stop = bounds[dim]
            low, high = chunk_bounds(
                stop - start, mesh.size(mesh_dim), coordinate[mesh_dim]
            )
            bounds[dim] = (start + low, start + high)
    return tuple(slice(start, stop) for start, stop in bounds)


def dtensor_from_local(local, mesh, placements, shape=None, stride=None):
    """A `DTensor` of this process' `local` piece, with no collective; `shape`
    is the global one where pieces may be uneven (DTensor assumes even ones)."""
    if shape is not None:
        shape = torch.Size(shape)
        stride = contiguous_strides(shape) if stride is None else stride
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=shape, stride=stride
    )


def replicate(x, mesh):
    """A plain tensor as a replicated `DTensor`; anything else as is."""
    if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or x.is_meta:
        return x
    return dtensor_from_local(x, mesh, [Replicate()] * mesh.ndim)


def redistribute(x, mesh, placements):
    """`x.redistribute(mesh, placements)` unless a no-op; on CPU a shard moving
    dimension is gathered first (DTensor's CPU all-to-all does so and warns)."""
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
    """`placements` with shards over size-1 mesh axes made `Replicate`, lest
    every weight gradient become `Partial` over such an axis."""
    return tuple(
        Replicate() if p.is_shard() and mesh.size(d) == 1 else p
        for d, p in enumerate(placements)
    )


def contiguous_strides(shape):
    """The strides of a contiguous tensor of `shape`, as torch computes them
    (an empty dimension counts as one)."""
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))
