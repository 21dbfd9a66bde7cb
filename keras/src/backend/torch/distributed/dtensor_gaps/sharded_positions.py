"""Argmax and argmin over a sharded dimension, which DTensor takes per shard
or refuses: shards all-gather their extreme and its position and take the
first extreme (NaN counting as one), as torch does."""

import torch

from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard


def positions(func, args, kwargs):
    """`func` (`aten.argmax`/`argmin`) of `x` over a `dim` one mesh dim splits,
    replicated over it; `None` without `dim`, for a partial or non-float `x`,
    or `dim` split several ways or into empty parts (alike on all processes)."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if (
        dim is None
        or x.ndim == 0
        or not x.dtype.is_floating_point
        or not isinstance(x, DTensor)
        or not all(p.is_replicate() or type(p) is Shard for p in x.placements)
    ):
        return None
    dim %= x.ndim
    splitting = [
        mesh_dim
        for mesh_dim, p in enumerate(x.placements)
        if p.is_shard() and p.dim % x.ndim == dim
    ]
    if len(splitting) != 1:
        return None
    (mesh_dim,) = splitting
    mesh = x.device_mesh
    num_parts = mesh.size(mesh_dim)
    start, stop = layouts.chunk_bounds(x.shape[dim], num_parts, num_parts - 1)
    if stop <= start:
        return None
    part = mesh.get_local_rank(mesh_dim)
    offset = layouts.chunk_bounds(x.shape[dim], num_parts, part)[0]
    extreme, position = (torch.min, torch.argmin)
    if func is torch.ops.aten.argmax.default:
        extreme, position = (torch.max, torch.argmax)
    values, indices = extreme(x.to_local(), dim=dim, keepdim=True)
    # float64 holds every float value and any position below 2**53.
    candidate = torch.stack([values.double(), (indices + offset).double()])
    gathered = candidate.new_empty((num_parts,) + tuple(candidate.shape))
    runtime.all_gather_flat(
        gathered.view(-1), candidate.reshape(-1), group=mesh.get_group(mesh_dim)
    )
    # Parts are in order along `dim`: the first extreme is the lowest.
    best = position(gathered[:, 0], dim=0, keepdim=True)
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
