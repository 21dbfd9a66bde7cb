"""Einsum, batched matmul and attention computed on each process' shards:
on `DTensor`s torch computes these through views merging a head or batch
dimension into a strided shard (which `fallback` gathers), or through
attention's math decomposition: every process would compute every head."""

import functools

import torch

from keras.src.backend.common.variables import Variable as KerasVariable
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Partial
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.core.runtime import Shard

# Labels of the stacked dimensions of a batched matmul, as an einsum.
_STACK_LABELS = "abcdefghlmnopq"


def local_einsum(function):
    """Wraps the backend's `einsum` (`function`) to run on local shards where
    each mesh axis shards one label evenly in every operand that has it (a
    contracted one gives a partial sum); else with `_gather_uneven_dims`."""

    @functools.wraps(function)
    def einsum(subscripts, *operands, **kwargs):
        if runtime.current_distribution() is None:
            return function(subscripts, *operands, **kwargs)
        split = _shard_local_einsum(subscripts, operands)
        if split is None:
            operands = [_gather_uneven_dims(x) for x in operands]
            return function(subscripts, *operands, **kwargs)
        mesh, placements, local_operands = split
        output = function(subscripts, *local_operands, **kwargs)
        return DTensor.from_local(output, mesh, placements, run_check=False)

    return einsum


def _gather_uneven_dims(x):
    """An einsum operand with the dimensions DTensor's einsum views cannot
    keep sharded gathered: uneven ones, or of size 1 (even over a mesh axis
    of size 1); its gradient comes back sharded like the operand."""
    if isinstance(x, KerasVariable):
        x = x.value
    if not isinstance(x, DTensor):
        return x
    placements = [
        Replicate()
        if p.is_shard()
        and (x.shape[p.dim] % x.device_mesh.size(i) or x.shape[p.dim] == 1)
        else p
        for i, p in enumerate(x.placements)
    ]
    if placements == list(x.placements):
        return x
    return layouts.redistribute(x, x.device_mesh, placements)


def local_matmul(function):
    """Wraps the backend's batched `matmul` (`function`) as `local_einsum`."""

    @functools.wraps(function)
    def matmul(x1, x2):
        if runtime.current_distribution() is None:
            return function(x1, x2)
        split = _shard_local_matmul(x1, x2)
        if split is None:
            return function(x1, x2)
        mesh, placements, (local1, local2) = split
        output = function(local1, local2)
        return DTensor.from_local(output, mesh, placements, run_check=False)

    return matmul


def _shard_local_matmul(x1, x2):
    """`_shard_local_einsum` of a batched `matmul` (rank > 2), or `None`."""
    shapes = [getattr(getattr(x, "value", x), "shape", None) for x in (x1, x2)]
    if any(shape is None or len(shape) < 3 for shape in shapes):
        return None
    if len(shapes[0]) != len(shapes[1]) or shapes[0][:-2] != shapes[1][:-2]:
        return None
    stacked = _STACK_LABELS[: len(shapes[0]) - 2]
    return _shard_local_einsum(
        f"{stacked}ij,{stacked}jk->{stacked}ik", (x1, x2)
    )


def _shard_local_einsum(subscripts, operands):
    """`(mesh, placements, local operands)` of a per-shard einsum, or `None`."""
    if torch.compiler.is_compiling():
        # Dynamo fails on this path (`InternalTorchDynamoError`).
        return None
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
    inputs = inputs.split(",")
    mesh = operands[0].device_mesh
    if len(inputs) != len(operands) or any(
        x.device_mesh != mesh for x in operands
    ):
        return None
    for labels, x in zip(inputs, operands):
        if len(set(labels)) != len(labels) or len(labels) != x.ndim:
            return None
    split_labels = []
    for mesh_dim in range(mesh.ndim):
        label = _split_label(inputs, operands, mesh_dim, mesh.size(mesh_dim))
        if label is False:
            return None
        split_labels.append(label)
    if projection and not any(split_labels):
        # DTensor's backward keeps a partial output gradient partial (reduced
        # once, later); this path would reduce it here.
        return None
    placements = [_placement(label, output) for label in split_labels]
    # An operand's gradient is partial where the split label is one it lacks
    # (each output part reads all of it).
    local_operands = [
        x.to_local(
            grad_placements=[_placement(s, labels) for s in split_labels]
        )
        for labels, x in zip(inputs, operands)
    ]
    return mesh, placements, local_operands


def _placement(label, labels):
    """The placement of a value with `labels` when `label` is split: a label
    it has shards it; one it lacks (contracted) leaves partial sums."""
    if label is None:
        return Replicate()
    if label in labels:
        return Shard(labels.index(label))
    return Partial()


def _split_label(inputs, operands, mesh_dim, num_shards):
    """The one label sharded on `mesh_dim`; `None` if none, `False` if the
    layout does not split (see `local_einsum`)."""
    found = set()
    for labels, x in zip(inputs, operands):
        placement = x.placements[mesh_dim]
        if placement.is_partial() or not (
            placement.is_replicate() or type(placement) is Shard
        ):
            return False
        if placement.is_shard():
            found.add(labels[placement.dim])
    if len(found) > 1:
        return False
    if not found:
        return None
    (label,) = found
    for labels, x in zip(inputs, operands):
        if label not in labels:
            continue
        # Slicing an operand replicated along the label costs nothing
        # forward, but an all-gather of its gradient backward.
        if not x.placements[mesh_dim].is_shard():
            return False
        if x.shape[labels.index(label)] % num_shards:
            return False
    return label


def local_attention(function):
    """Wraps the backend's `dot_product_attention` (`function`) to attend
    shard by shard where sharded on batch or heads only (DTensor's math
    decomposition cannot shard under `torch.compile`). Replicated key and
    value (fewer heads than processes) give each process the heads its query
    heads read. The flash probe (`SDPAParams`) is skipped: dynamo cannot
    trace it, and torch tries flash first anyway."""

    @functools.wraps(function)
    def attention(query, key, value, *args, **kwargs):
        if runtime.current_distribution() is None or not _shard_local_attention(
            query, key, value, args, kwargs
        ):
            return function(query, key, value, *args, **kwargs)
        if kwargs.get("flash_attention") is None:
            kwargs["flash_attention"] = False
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
    # At most one mesh dimension splits the query's heads but not the
    # key's and value's (see `_reads_whole_heads`).
    differing = [
        mesh_dim
        for mesh_dim, own in enumerate(key.placements)
        if own != placements[mesh_dim]
    ]
    if len(differing) > 1:
        return False
    for x in (key, value):
        if x.device_mesh != mesh:
            return False
        if differing and not _reads_whole_heads(query, x, differing[0]):
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


def _reads_whole_heads(query, key, mesh_dim):
    """Whether a replicated `key` (or value) gives whole the key/value heads
    each process' query heads read, over `mesh_dim` (grouped-query)."""
    placement = query.placements[mesh_dim]
    if not (
        key.placements[mesh_dim].is_replicate()
        and type(placement) is Shard
        and placement.dim == 2
    ):
        return False
    heads, key_heads = query.shape[2], key.shape[2]
    size = query.device_mesh.size(mesh_dim)
    if heads % size or heads % key_heads:
        return False
    local_heads, group = heads // size, heads // key_heads
    return local_heads % group == 0 or group % local_heads == 0


def _local_key_value_heads(x, query):
    """Local key or value `x`: where replicated, the heads this process'
    query heads read, with a partial gradient."""
    mesh = query.device_mesh
    whole = [
        mesh_dim
        for mesh_dim, own in enumerate(x.placements)
        if own != query.placements[mesh_dim]
    ]
    if not whole:
        return x.to_local()
    grad_placements = list(x.placements)
    for mesh_dim in whole:
        grad_placements[mesh_dim] = Partial()
    local = x.to_local(grad_placements=grad_placements)
    heads, key_heads = query.shape[2], x.shape[2]
    group = heads // key_heads
    for mesh_dim in whole:
        local_heads = heads // mesh.size(mesh_dim)
        first = mesh.get_local_rank(mesh_dim) * local_heads
        start, stop = first // group, (first + local_heads - 1) // group + 1
        local = local[:, :, start:stop]
    return local


def _scores_like(mask, query):
    """Whether `mask` (`None`, or of the scores' shape) splits as the query:
    each dimension sharded alike, or of size 1 and replicated."""
    if mask is None:
        return True
    if not isinstance(mask, DTensor) or mask.requires_grad or mask.ndim != 4:
        return False
    if mask.device_mesh != query.device_mesh:
        return False
    scores_dim = {0: 0, 2: 1}
    for placement, own in zip(query.placements, mask.placements):
        if placement.is_replicate():
            if not own.is_replicate():
                return False
            continue
        dim = scores_dim[placement.dim]
        if own.is_replicate() and mask.shape[dim] == 1:
            continue
        if not (type(own) is Shard and own.dim == dim):
            return False
        if mask.shape[dim] != query.shape[placement.dim]:
            return False
    return True
