"""Einsum, matmul, attention on local shards, where DTensor makes a sharded head
or batch dim a strided shard (`fallback` gathers) or runs all heads on all."""

import functools

import torch

from keras.src.backend.common.variables import Variable as KerasVariable
from keras.src.backend.config import standardize_data_format
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Partial
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard

_STACK_LABELS = "abcdefghlmnopq"  # Labels of stacked matmul dims, as an einsum.


def local_einsum(function):
    """Wraps the backend's `einsum` to run on local shards where each mesh axis
    shards one label evenly in every operand having it; else via DTensor."""

    @functools.wraps(function)
    def einsum(subscripts, *operands, **kwargs):
        if runtime.current_distribution() is None:
            return function(subscripts, *operands, **kwargs)
        compute = functools.partial(function, subscripts, **kwargs)
        output = _shard_local_einsum(subscripts, operands, compute)
        if output is None:
            output = compute(*[_gather_uneven_dims(x) for x in operands])
        return output

    return einsum


def _gather_uneven_dims(x):
    """An einsum operand with dims DTensor's einsum views cannot keep sharded
    (uneven, or of size 1) gathered; its gradient comes back sharded alike."""
    x = x.value if isinstance(x, KerasVariable) else x
    if not isinstance(x, DTensor):
        return x
    placements = [
        Replicate()
        if p.is_shard()
        and (x.shape[p.dim] % x.device_mesh.size(i) or x.shape[p.dim] == 1)
        else p
        for i, p in enumerate(x.placements)
    ]
    return layouts.redistribute(x, x.device_mesh, placements)


def local_matmul(function):
    """Wraps `matmul` as `local_einsum` if batched (rank > 2, stacks alike)."""

    @functools.wraps(function)
    def matmul(x1, x2):
        if runtime.current_distribution() is None:
            return function(x1, x2)
        shape1, shape2 = (
            getattr(getattr(x, "value", x), "shape", ()) for x in (x1, x2)
        )
        output = None
        if len(shape1) == len(shape2) > 2 and shape1[:-2] == shape2[:-2]:
            stacked = _STACK_LABELS[: len(shape1) - 2]
            subscripts = f"{stacked}ij,{stacked}jk->{stacked}ik"
            output = _shard_local_einsum(subscripts, (x1, x2), function)
        return function(x1, x2) if output is None else output

    return matmul


def _shard_local_einsum(subscripts, operands, compute):
    """`compute(*local operands)` as a `DTensor` where it splits, or `None`."""
    if torch.compiler.is_compiling():
        return None  # Dynamo fails on this path (`InternalTorchDynamoError`).
    projection = any(isinstance(x, KerasVariable) for x in operands)
    operands = [
        x.value if isinstance(x, KerasVariable) else x for x in operands
    ]
    # A plain operand's part would need this process' mesh coordinates,
    # and its gradient a reduction: such einsums go to DTensor.
    if not operands or not all(isinstance(x, DTensor) for x in operands):
        return None
    if "." in subscripts or "->" not in subscripts:
        return None
    inputs, output = subscripts.replace(" ", "").split("->")
    inputs, mesh = inputs.split(","), operands[0].device_mesh
    if len(inputs) != len(operands) or any(
        x.device_mesh != mesh or not len(set(labels)) == len(labels) == x.ndim
        for labels, x in zip(inputs, operands)
    ):
        return None
    split_labels = [_split_label(inputs, operands, d) for d in range(mesh.ndim)]
    # With no split label, DTensor's backward keeps a projection's partial
    # output gradient partial (reduced once, later); here it would be reduced.
    if False in split_labels or (projection and not any(split_labels)):
        return None
    local_operands = []
    for labels, x in zip(inputs, operands):
        grad = [_placement(s, labels) for s in split_labels]
        local_operands.append(x.to_local(grad_placements=grad))
    placements = [_placement(label, output) for label in split_labels]
    return DTensor.from_local(
        compute(*local_operands), mesh, placements, run_check=False
    )


def _placement(label, labels):
    """The placement of a value with `labels` when `label` is split: a label
    it has shards it; one it lacks (contracted) leaves partial sums."""
    if label is None:
        return Replicate()
    return Shard(labels.index(label)) if label in labels else Partial()


def _split_label(inputs, operands, mesh_dim):
    """The one label sharded on `mesh_dim`; `None` if none, `False` if the
    layout does not split (see `local_einsum`)."""
    placements = [x.placements[mesh_dim] for x in operands]
    if not all(p.is_replicate() or type(p) is Shard for p in placements):
        return False
    found = {
        labels[p.dim] for labels, p in zip(inputs, placements) if p.is_shard()
    }
    if len(found) != 1:
        return False if found else None
    (label,) = found
    num_shards = operands[0].device_mesh.size(mesh_dim)
    # Cutting a label-replicated operand is free, but all-gathers its gradient.
    if any(
        label in labels
        and (not p.is_shard() or x.shape[labels.index(label)] % num_shards)
        for labels, x, p in zip(inputs, operands, placements)
    ):
        return False
    return label


def local_conv(function):
    """Wraps the backend's `conv` to convolve each process' channels (as
    `local_einsum` splits a product) where the kernel is sharded on its output
    or input channels (one group), the inputs' other shards gathered."""

    @functools.wraps(function)
    def conv(inputs, kernel, *args, **kwargs):
        if runtime.current_distribution() is None:
            return function(inputs, kernel, *args, **kwargs)
        x, w = (getattr(v, "value", v) for v in (inputs, kernel))
        data_format = args[2] if len(args) > 2 else kwargs.get("data_format")
        first = standardize_data_format(data_format) == "channels_first"
        space = "defg"[: getattr(x, "ndim", 2) - 2]
        labels = "nc" + space if first else f"n{space}c"
        window, c = space.upper() + "co", labels.index("c")
        compute = lambda x, w: function(x, w, *args, **kwargs)  # noqa: E731
        shards = [p.dim for p in getattr(w, "placements", ()) if p.is_shard()]
        if not (
            isinstance(x, DTensor)
            and not torch.compiler.is_compiling()
            and shards
            and all(window[d] in "co" for d in shards)
            and x.shape[c] == w.shape[-2]  # One group.
        ):
            return compute(inputs, kernel)
        by_kernel = [q.is_shard(w.ndim - 2) for q in w.placements]
        kept = [  # The batch, and channels sharded as the kernel's.
            p if p.is_shard(0) or p.is_shard(c) and k else Replicate()
            for p, k in zip(x.placements, by_kernel)
        ]
        x = layouts.redistribute(x, x.device_mesh, kept)
        subscripts = f"{labels},{window}->{labels.replace('c', 'o')}"
        output = _shard_local_einsum(subscripts, (x, w), compute)
        return compute(x, kernel) if output is None else output

    return conv


def local_attention(function):
    """Wraps `dot_product_attention` (`function`) to attend shard by shard
    where sharded on batch or heads only (DTensor's math decomposition cannot
    shard under `torch.compile`); no flash probe (dynamo cannot trace it)."""

    @functools.wraps(function)
    def attention(query, key, value, *args, **kwargs):
        if runtime.current_distribution() is None or not _shard_local_attention(
            query, key, value, args, kwargs
        ):
            return function(query, key, value, *args, **kwargs)
        kwargs["flash_attention"] = kwargs.get("flash_attention") or False
        for name in ("mask", "bias"):
            if isinstance(kwargs.get(name), DTensor):
                kwargs[name] = kwargs[name].to_local()
        key, value = (_local_key_value_heads(x, query) for x in (key, value))
        output = function(query.to_local(), key, value, **kwargs)
        return DTensor.from_local(
            output, query.device_mesh, query.placements, run_check=False
        )

    return attention


def _shard_local_attention(query, key, value, args, kwargs):
    """Whether attention splits per shard: `DTensor`s laid out alike, sharded
    evenly on batch (0) or heads (2) only, mask and bias like the scores."""
    if args or not all(isinstance(x, DTensor) for x in (query, key, value)):
        return False
    mesh, placements = query.device_mesh, query.placements
    if key.placements != value.placements or key.ndim != 4:
        return False
    if value.ndim != 4 or key.shape[2] != value.shape[2]:
        return False
    # At most one mesh dimension splits the query's heads, not the key's and
    # value's, where each process' query heads read whole key/value heads.
    differing = [d for d, p in enumerate(key.placements) if p != placements[d]]
    if len(differing) > 1 or any(x.device_mesh != mesh for x in (key, value)):
        return False
    for mesh_dim in differing:
        heads, key_heads = query.shape[2], key.shape[2]
        size, placement = mesh.size(mesh_dim), placements[mesh_dim]
        if (
            not key.placements[mesh_dim].is_replicate()
            or type(placement) is not Shard
            or placement.dim != 2
            or heads % size
            or heads % key_heads
        ):
            return False
        local_heads, group = heads // size, heads // key_heads
        if local_heads % group and group % local_heads:
            return False
    for mesh_dim, placement in enumerate(placements):
        if placement.is_replicate():
            continue
        if not placement.is_shard() or placement.dim not in (0, 2):
            return False
        size = mesh.size(mesh_dim)
        if any(
            x.shape[placement.dim] % size
            for x in (query, key, value)
            if x.placements[mesh_dim] == placement
        ):
            return False
    return all(
        _scores_like(kwargs.get(name), query) for name in ("mask", "bias")
    )


def _local_key_value_heads(x, query):
    """Local key or value `x`: where replicated (fewer heads than processes),
    the heads this process' query heads read, with a partial gradient."""
    mesh, placements = query.device_mesh, query.placements
    whole = [d for d, p in enumerate(x.placements) if p != placements[d]]
    if not whole:
        return x.to_local()
    (mesh_dim,) = whole
    grad = [Partial() if d in whole else p for d, p in enumerate(x.placements)]
    local_heads = query.shape[2] // mesh.size(mesh_dim)
    group = query.shape[2] // x.shape[2]
    first = mesh.get_local_rank(mesh_dim) * local_heads
    stop = (first + local_heads - 1) // group + 1
    return x.to_local(grad_placements=grad)[:, :, first // group : stop]


def _scores_like(mask, query):
    """Whether `mask` (`None`, or of the scores' shape) splits as the query:
    each dimension sharded alike, or of size 1 and replicated."""
    if mask is None:
        return True
    if not isinstance(mask, DTensor) or mask.requires_grad or mask.ndim != 4:
        return False
    if mask.device_mesh != query.device_mesh:
        return False
    for placement, own in zip(query.placements, mask.placements):
        if placement.is_replicate():
            alike = own.is_replicate()
        else:
            dim = {0: 0, 2: 1}[placement.dim]
            alike = (own.is_replicate() and mask.shape[dim] == 1) or (
                type(own) is Shard
                and own.dim == dim
                and mask.shape[dim] == query.shape[placement.dim]
            )
        if not alike:
            return False
    return True
