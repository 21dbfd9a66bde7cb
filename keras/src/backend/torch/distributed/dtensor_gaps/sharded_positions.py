"""Argmax and argmin over a sharded dimension, which DTensor takes per shard
or refuses: shards all-gather their extreme and its position and take the
first extreme (NaN counting as one), as torch does."""

import torch

from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard
from keras.src.backend.torch.distributed.dtensor_gaps import global_values

_ON_GLOBAL_VALUES = (
    "positions (argmax, argmin) taken over a sharded dimension, which "
    "newer DTensor releases take per shard"
)


def positions(func, args, kwargs):
    """`aten.argmax`/`argmin` reducing a sharded or partial dim of `x` (else
    `None`: DTensor's is right): by shards where one mesh dim splits `dim` into
    non-empty parts of a float `x` with no partial, else on global values."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if dim is not None:
        dim %= max(x.ndim, 1)
    splitting = [
        mesh_dim
        for mesh_dim, p in enumerate(x.placements)
        if p.is_shard() and dim in (None, p.dim % x.ndim)
    ]
    if not splitting and not any(p.is_partial() for p in x.placements):
        return None
    mesh = x.device_mesh
    num_parts = mesh.size(splitting[0]) if splitting else 1
    if (
        dim is None
        or len(splitting) != 1
        or not x.dtype.is_floating_point
        or not all(p.is_replicate() or type(p) is Shard for p in x.placements)
        or layouts.chunk_bounds(x.shape[dim], num_parts, num_parts - 1)[0]
        == x.shape[dim]
    ):
        return global_values.on_global_values(
            func, args, kwargs, _ON_GLOBAL_VALUES, str(func)
        )
    (mesh_dim,) = splitting
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
    shape = [1 if d == dim else n for d, n in enumerate(x.shape)]
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
