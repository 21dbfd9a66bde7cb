"""What a distribution stores on this process, from local metadata only (no
collective), so any process may ask alone."""

import numpy as np

from keras.src.backend.torch.distributed.core import layout_rules
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.dtensor_gaps import fallback

NO_RULE = "(no rule)"


def mesh_info(device_mesh=None):
    """Describes a device mesh and this process' place in it.

    Args:
        device_mesh: a `DeviceMesh`; defaults to the current distribution's.

    Returns:
        A dict with `shape`, `axis_names`, `devices` (Keras device names,
        nested), `process_id`, `num_processes` and `coordinate` (this
        process' index along each mesh axis, or `None` outside the mesh).
    """
    if device_mesh is None:
        distribution = runtime.current_distribution()
        if distribution is None:
            raise ValueError(
                "No distribution is set. Pass a `DeviceMesh`, or call "
                "`keras.distribution.set_distribution(...)` first."
            )
        device_mesh = distribution.device_mesh
    return {
        "shape": tuple(device_mesh.shape),
        "axis_names": tuple(device_mesh.axis_names),
        "devices": device_mesh.devices.tolist(),
        "process_id": runtime.rank(),
        "num_processes": runtime.world_size(),
        "coordinate": _coordinate(device_mesh),
    }


def _coordinate(device_mesh):
    """This process' index along each mesh axis, or `None`, read from device
    names (`"gpu:i"` is rank `i`): building the torch mesh is a collective."""
    ranks = np.vectorize(lambda d: layouts.to_torch_device(d)[1])(
        device_mesh.devices
    )
    found = np.argwhere(ranks == runtime.rank())
    if len(found) == 0:
        return None
    return tuple(int(i) for i in found[0])


def sharding_summary(model, print_fn=None):
    """Lists how each variable of a model is laid out on this process.

    Args:
        model: a Keras model or layer (anything with `.variables`).
        print_fn: if given, called with a table of the variables and of the
            ops DTensor refused.

    Returns:
        A list of dicts, one per variable: `path`, `dtype`, `global_shape`,
        `placements` (per mesh axis, `"R"` or `"S(d)"`; `("R",)` for a plain
        tensor), `local_shape`, `local_bytes` (stored on this process) and
        `layout_rule`: the matching `LayoutMap` key, else the plan's reason
        under `AutoModelParallel` (`"auto: ..."`), else `None`.
    """
    distribution = runtime.current_distribution()
    layout_map = layout_rules.layout_map_of(distribution)
    reason_of = getattr(distribution, "layout_reason", None)
    rows = [_variable_row(v, layout_map, reason_of) for v in model.variables]
    if print_fn is not None:
        print_fn(_format_rows(rows))
    return rows


def _variable_row(variable, layout_map, reason_of=None):
    value = variable.value
    local = value.to_local() if isinstance(value, DTensor) else value
    placements = tuple(str(p) for p in getattr(value, "placements", ("R",)))
    rule = None
    if layout_map is not None:
        rule = layout_rules.matching_rule(layout_map, variable.path)
    if rule is None and reason_of is not None:
        rule = reason_of(variable.path)
    return {
        "path": variable.path,
        "dtype": str(variable.dtype),
        "global_shape": tuple(value.shape),
        "placements": placements,
        "local_shape": tuple(local.shape),
        "local_bytes": local.numel() * local.element_size(),
        "layout_rule": rule,
    }


def _format_rows(rows):
    prefix = f"[rank {runtime.rank()}] "
    header = (
        "path",
        "global shape",
        "placements",
        "local shape",
        "bytes",
        "layout rule",
    )
    table = [header] + [
        (
            r["path"],
            str(r["global_shape"]),
            ", ".join(r["placements"]),
            str(r["local_shape"]),
            str(r["local_bytes"]),
            NO_RULE if r["layout_rule"] is None else r["layout_rule"],
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [
        prefix
        + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
        for row in table
    ]
    total = sum(r["local_bytes"] for r in rows)
    lines.append(f"{prefix}total bytes on this process: {total}")
    lines.extend(prefix + line for line in _fallback_lines())
    return "\n".join(lines)


def _fallback_lines():
    """The ops DTensor refused so far, each computed on global values."""
    counts = fallback.fallback_counts()
    if not counts:
        return []
    lines = ["ops computed on global values (DTensor refused their layout):"]
    for name, count in sorted(counts.items()):
        lines.append(
            f"  {name}: {count.calls} calls, {count.gathered_bytes} bytes "
            f"gathered ({count.reason})"
        )
    return lines
