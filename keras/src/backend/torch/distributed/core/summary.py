"""What this process stores, from local metadata: any process may ask alone."""

import numpy as np

from keras.src.backend.torch.distributed.core import layout_rules
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.dtensor_gaps import fallback


def mesh_info(device_mesh=None):
    """Describes a device mesh and this process' place in it.

    Args:
        device_mesh: a `DeviceMesh`; defaults to the current distribution's.

    Returns:
        A dict: `shape`, `axis_names`, `devices` (Keras names), `process_id`,
        `num_processes`, `coordinate` (this process' index per axis, or `None`).
    """
    if device_mesh is None:
        distribution = runtime.current_distribution()
        if distribution is None:
            raise ValueError(
                "No distribution is set. Pass a `DeviceMesh`, or call "
                "`keras.distribution.set_distribution(...)` first."
            )
        device_mesh = distribution.device_mesh
    # Ranks from device names (`"gpu:i"`): building a torch mesh is collective.
    to_rank = np.vectorize(lambda d: layouts.to_torch_device(d)[1])
    found = np.argwhere(to_rank(device_mesh.devices) == runtime.rank())
    return {
        "shape": tuple(device_mesh.shape),
        "axis_names": tuple(device_mesh.axis_names),
        "devices": device_mesh.devices.tolist(),
        "process_id": runtime.rank(),
        "num_processes": runtime.world_size(),
        "coordinate": tuple(int(i) for i in found[0]) if len(found) else None,
    }


def sharding_summary(model, print_fn=None):
    """Lists how each variable of a model is laid out on this process.

    Args:
        model: a Keras model or layer (anything with `.variables`).
        print_fn: if given, gets a table of variables and ops DTensor refused.

    Returns:
        A list of dicts, one per variable: `path`, `dtype`, `global_shape`,
        `placements` (per mesh axis, `"R"` or `"S(d)"`; `("R",)` if plain),
        `local_shape`, `local_bytes` and `layout_rule`: the matching `LayoutMap`
        key, else the `AutoModelParallel` reason (`"auto: ..."`), else `None`.
    """
    distribution = runtime.current_distribution()
    layout_map = layout_rules.layout_map_of(distribution)
    reason_of = getattr(distribution, "layout_reason", None)
    rows = []
    for variable in model.variables:
        value = variable.value
        local = value.to_local() if isinstance(value, DTensor) else value
        rule = layout_rules.matching_rule(layout_map, variable.path)
        if rule is None and reason_of is not None:
            rule = reason_of(variable.path)
        placements = getattr(value, "placements", ("R",))
        rows.append(
            {
                "path": variable.path,
                "dtype": str(variable.dtype),
                "global_shape": tuple(value.shape),
                "placements": tuple(str(p) for p in placements),
                "local_shape": tuple(local.shape),
                "local_bytes": local.numel() * local.element_size(),
                "layout_rule": rule,
            }
        )
    if print_fn is not None:
        print_fn(_format_rows(rows))
    return rows


def _format_rows(rows):
    """The table `sharding_summary` prints, each line naming this process."""
    header = "path|global shape|placements|local shape|bytes|layout rule"
    table = [header.split("|")] + [
        [
            r["path"],
            str(r["global_shape"]),
            ", ".join(r["placements"]),
            str(r["local_shape"]),
            str(r["local_bytes"]),
            "(no rule)" if r["layout_rule"] is None else r["layout_rule"],
        ]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(6)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
        for row in table
    ]
    total = sum(r["local_bytes"] for r in rows)
    lines.append(f"total bytes on this process: {total}")
    if counts := fallback.fallback_counts():
        lines.append(
            "ops computed on global values (DTensor refused their layout):"
        )
    lines.extend(
        f"  {name}: {count.calls} calls, {count.gathered_bytes} bytes "
        f"gathered ({count.reason})"
        for name, count in sorted(counts.items())
    )
    return "\n".join(f"[rank {runtime.rank()}] {line}" for line in lines)
