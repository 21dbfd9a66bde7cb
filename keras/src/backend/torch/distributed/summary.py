"""What a distribution physically stores on this process (torch backend).

Reads only local metadata: nothing here runs a collective, so any process may
call it on its own (from a debugger, or on rank 0 only).
"""

from keras.src.backend.torch.distributed import runtime
from keras.src.backend.torch.distributed.runtime import DTensor


def mesh_info(device_mesh=None):
    """Describes a device mesh and this process' place in it.

    Args:
        device_mesh: a `keras.distribution.DeviceMesh`; defaults to the mesh
            of the current distribution.

    Returns:
        A dict with `shape`, `axis_names`, `devices` (the Keras device names,
        as a nested list), `process_id`, `num_processes` and `coordinate`
        (this process' index along each mesh axis, or `None` if it is not in
        the mesh).
    """
    if device_mesh is None:
        distribution = runtime.current_distribution()
        if distribution is None:
            raise ValueError(
                "No distribution is set. Pass a `DeviceMesh`, or call "
                "`keras.distribution.set_distribution(...)` first."
            )
        device_mesh = distribution.device_mesh
    torch_mesh = device_mesh.backend_mesh
    coordinate = torch_mesh.get_coordinate()
    return {
        "shape": tuple(device_mesh.shape),
        "axis_names": tuple(device_mesh.axis_names),
        "devices": device_mesh.devices.tolist(),
        "process_id": runtime.rank(),
        "num_processes": runtime.world_size(),
        "coordinate": None if coordinate is None else tuple(coordinate),
    }


def sharding_summary(model, print_fn=None):
    """Lists how each variable of a model is laid out on this process.

    Args:
        model: a Keras model or layer (anything with `.variables`).
        print_fn: if given, called with a formatted table, one line per
            variable, prefixed with this process' rank.

    Returns:
        A list of dicts, one per variable: `path`, `dtype`, `global_shape`,
        `placements` (one string per mesh axis, `"R"` or `"S(d)"`; one `"R"`
        for a plain tensor),
        `local_shape` and `local_bytes` (what this process stores).
    """
    rows = [_variable_row(v) for v in model.variables]
    if print_fn is not None:
        print_fn(_format_rows(rows))
    return rows


def _variable_row(variable):
    value = variable.value
    if isinstance(value, DTensor):
        placements = tuple(str(p) for p in value.placements)
        local = value.to_local()
    else:
        placements = ("R",)
        local = value
    return {
        "path": variable.path,
        "dtype": str(variable.dtype),
        "global_shape": tuple(value.shape),
        "placements": placements,
        "local_shape": tuple(local.shape),
        "local_bytes": local.numel() * local.element_size(),
    }


def _format_rows(rows):
    prefix = f"[rank {runtime.rank()}] "
    header = ("path", "global shape", "placements", "local shape", "bytes")
    table = [header] + [
        (
            r["path"],
            str(r["global_shape"]),
            ", ".join(r["placements"]),
            str(r["local_shape"]),
            str(r["local_bytes"]),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [
        prefix + "  ".join(cell.ljust(w) for cell, w in zip(row, widths))
        for row in table
    ]
    total = sum(r["local_bytes"] for r in rows)
    lines.append(f"{prefix}total bytes on this process: {total}")
    return "\n".join(lines)
