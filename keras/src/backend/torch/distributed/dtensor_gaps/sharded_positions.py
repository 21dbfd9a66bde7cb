"""Argmax and argmin over a sharded dimension, from each shard's best.

DTensor takes `argmax(x, dim)` over a sharded `dim` per shard or refuses it;
rather than gather `x`, shards all-gather their extreme and its position and
take the first extreme (NaN counting as one), as torch does.
"""

import torch

from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard

_ARGMAX = torch.ops.aten.argmax.default


def positions(func, args, kwargs):
    """`func` (`aten.argmax`/`argmin`) of `x` over a `dim` one mesh dim splits,
    replicated over it; `None` without `dim`, for a partial or non-float `x`,
    or `dim` split several ways or into empty parts (alike on all processes).
    """
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    mesh_dim = _splitting_mesh_dim(x, dim)
    if mesh_dim is None:
        return None
    dim %= x.ndim
    mesh = x.device_mesh
    num_parts = mesh.size(mesh_dim)
    start, stop = layouts.chunk_bounds(x.shape[dim], num_parts, num_parts - 1)
    if stop <= start:
        return None
    part = mesh.get_local_rank(mesh_dim)
    offset = layouts.chunk_bounds(x.shape[dim], num_parts, part)[0]
    extreme = torch.max if func is _ARGMAX else torch.min
    values, indices = extreme(x.to_local(), dim=dim, keepdim=True)
    candidate = torch.stack(
        # float64 holds every float value and any position below 2**53.
        [values.to(torch.float64), (indices + offset).to(torch.float64)]
    )
    gathered = candidate.new_empty(num_parts * candidate.numel())
    runtime.all_gather_flat(
        gathered, candidate.reshape(-1), group=mesh.get_group(mesh_dim)
    )
    gathered = gathered.view((num_parts,) + tuple(candidate.shape))
    # Parts are in order along `dim`: the first extreme is the lowest.
    best = (torch.argmax if func is _ARGMAX else torch.argmin)(
        gathered[:, 0], dim=0, keepdim=True
    )
    local = torch.gather(gathered[:, 1], 0, best)[0].to(torch.int64)
    shape = list(x.shape)
    shape[dim] = 1
    placements = list(x.placements)
    placements[mesh_dim] = Replicate()
    if not keepdim:
        local = local.squeeze(dim)
        del shape[dim]
        placements = [
            Shard(p.dim - 1) if p.is_shard() and p.dim > dim else p
            for p in placements
        ]
    return layouts.dtensor_from_local(local, mesh, placements, shape=shape)


def _splitting_mesh_dim(x, dim):
    """The one mesh dimension that splits `dim` of `x`, or `None`."""
    if (
        dim is None
        or x.ndim == 0
        or not x.dtype.is_floating_point
        or not isinstance(x, DTensor)
    ):
        return None
    dim %= x.ndim
    splitting = []
    for mesh_dim, placement in enumerate(x.placements):
        if placement.is_partial() or not (
            placement.is_replicate() or type(placement) is Shard
        ):
            return None
        if placement.is_shard() and placement.dim % x.ndim == dim:
            splitting.append(mesh_dim)
    return splitting[0] if len(splitting) == 1 else None
