"""Global batches as batch-sharded DTensors, each process keeping its rows; no
communication if the global size is known."""

import weakref

from keras.src.backend.torch.distributed.core import collectives
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core import structures
from keras.src.backend.torch.distributed.core.runtime import DTensor

_DATA_LAYOUTS = weakref.WeakKeyDictionary()


def distribute_global_batch(data, distribution):
    """`data`'s arrays as DTensors sharded on the batch axis; with
    `auto_shard_dataset=False`, `data` is this process' part of the batch."""
    leaves = [x for x in structures.flatten(data) if _is_batch_array(x)]
    if not leaves:
        return data
    batch_size = int(leaves[0].shape[0])
    if not distribution.auto_shard_dataset:
        return global_batch(data, None, distribution, batch_size)
    mesh = distribution.device_mesh.backend_mesh
    dim = mesh.mesh_dim_names.index(distribution.batch_dim_name)
    rows = layouts.chunk_bounds(
        batch_size, mesh.size(dim), mesh.get_coordinate()[dim]
    )
    return global_batch(data, batch_size, distribution, batch_size, rows)


def _data_layout(distribution, shape):
    """`(layout, placements, kept)` of a global batch of `shape`: the
    `TorchLayout` of `distribution.get_data_layout(shape)`, its placements
    without shards on size-1 axes, and those the batch is kept in (`_put`)."""
    known = _DATA_LAYOUTS.setdefault(distribution, {})
    if shape not in known:
        if len(known) >= 64:  # Bounds the cache for batches of many lengths.
            known.clear()
        layout = layouts.as_torch_layout(distribution.get_data_layout(shape))
        mesh = layout.device_mesh
        placements = layouts.drop_unit_shards(mesh, layout.placements)
        kept = layouts.without_empty_shards(shape, mesh, placements)
        known[shape] = (layout, placements, kept)
    return known[shape]


def distribute_data_input(
    per_process_batch, layout, batch_dim_name, global_batch_size=None
):
    """Assembles the global batch (`DTensor`s of `layout`) from each process'
    part (nested arrays): the processes along the mesh axis `batch_dim_name`
    hold consecutive parts, sized as `torch.chunk` splits the batch, the others
    the same; `global_batch_size=None` exchanges the parts' sizes."""
    layout = layouts.as_torch_layout(layout)
    leaves = structures.flatten(per_process_batch)
    if not leaves:
        return per_process_batch
    if global_batch_size is None:
        global_batch_size = _global_size(leaves[0], layout, batch_dim_name)
    placements = layouts.drop_unit_shards(layout.device_mesh, layout.placements)
    return structures.map_structure(
        lambda x: _put(x, layout, placements, global_batch_size),
        per_process_batch,
    )


def _put(x, layout, placements, global_batch_size, kept=None):
    """This process' part `x` as a DTensor of the global batch with
    `placements`, kept in `kept` (default: computed from the global shape)."""
    x = collectives.as_local_tensor(x)
    layouts.check_rank(x, layout, "data input")
    local = tuple(x.shape)
    shape = (global_batch_size,) + local[1:]
    runtime.log_debug(
        "data input: local %s -> global %s %s", local, shape, placements
    )
    mesh = layout.device_mesh
    value = layouts.dtensor_from_local(x, mesh, placements, shape=shape)
    if kept is None:
        kept = layouts.without_empty_shards(shape, mesh, placements)
    if kept != tuple(placements):
        # A process without rows would fail alone in some kernels (a `max`
        # over the batch) while the others go on: gathered.
        value = value.redistribute(mesh, kept)
    return value


def global_batch(data, global_size, distribution, batch_size=None, rows=None):
    """The global batch of `global_size` (`None`: gathered) from this process'
    part `data`, or its `rows` `(start, stop)`; with `batch_size`, checks that
    every array of `data` has as many rows."""
    sizes = [global_size]  # Gathered once for all arrays.

    def put(x):
        if not _is_batch_array(x):
            return x
        if batch_size is not None and int(x.shape[0]) != batch_size:
            raise ValueError(
                "All inputs of a batch must have the same batch size. "
                f"Received sizes {batch_size} and {int(x.shape[0])}."
            )
        size = int(x.shape[0]) if global_size is None else global_size
        shape = (size,) + tuple(x.shape[1:])
        layout, placements, kept = _data_layout(distribution, shape)
        x = x if rows is None else x[rows[0] : rows[1]]
        if sizes[0] is None:
            sizes[0] = _global_size(x, layout, distribution.batch_dim_name)
        if sizes[0] != size:
            kept = None  # Kept placements are those of the gathered size.
        return _put(x, layout, placements, sizes[0], kept)

    return structures.map_structure(put, data)


def _global_size(x, layout, batch_dim_name):
    """The global batch size of parts like `x` of the processes along
    `batch_dim_name`, checked to be parts `torch.chunk` would split."""
    local_size = int(x.shape[0] if hasattr(x, "shape") else len(x))
    mesh = layout.device_mesh
    if batch_dim_name not in (mesh.mesh_dim_names or ()):
        raise ValueError(
            f"The batch axis '{batch_dim_name}' is not an axis of the device "
            f"mesh {mesh.mesh_dim_names}."
        )
    sizes = [local_size]
    if mesh.size(mesh.mesh_dim_names.index(batch_dim_name)) > 1:
        group = mesh.get_group(batch_dim_name)
        sizes = [n for (n,) in collectives.all_gather_ints(sizes, group)]
    global_batch_size, n = sum(sizes), len(sizes)
    bounds = [layouts.chunk_bounds(global_batch_size, n, i) for i in range(n)]
    expected = [stop - start for start, stop in bounds]
    if sizes != expected:
        raise ValueError(
            f"The per-process batch sizes {sizes} cannot form a global "
            f"batch of {global_batch_size}: processes along the batch axis "
            f"must hold parts sized like `torch.chunk` splits it "
            f"({expected}), i.e. equal parts except a smaller last one. "
            "Give every process the same batch size."
        )
    return global_batch_size


def _is_batch_array(x):
    return (
        hasattr(x, "shape") and len(x.shape) > 0 and not isinstance(x, DTensor)
    )
