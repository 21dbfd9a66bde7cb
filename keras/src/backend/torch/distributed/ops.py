"""Ops that DTensor alone would not compute as one process does.

DTensor convolves a sharded kernel wrongly, mis-reduces a sharded lookup
with sharded indices, and draws random numbers per shard: the torch
backend's convolution, `take` and dropout hand their operands here first.
Where DTensor refuses an op, `fallback` computes it on global values
(`slice_update` on a sharded prompt included). Two ops keep a path of their
own here because the fallback would compute all of them on every process:
einsum runs shard by shard where its sharded labels are kept in the output
(heads, batch rows) and gathers only its unevenly sharded dimensions (a
single key/value head), so that the query's heads stay sharded, and
attention runs shard by shard.
"""

import functools

import torch

from keras.src.backend.common.variables import Variable as KerasVariable
from keras.src.backend.torch.distributed import fallback
from keras.src.backend.torch.distributed import layouts
from keras.src.backend.torch.distributed import runtime
from keras.src.backend.torch.distributed.runtime import DTensor

# Labels of the stacked dimensions of a batched matmul, as an einsum.
_STACK_LABELS = "abcdefghlmnopq"

if runtime.DTENSOR_AVAILABLE:
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard


def conv_operands(inputs, kernel):
    """Lays out convolution operands the way DTensor can convolve them.

    DTensor convolves correctly only inputs sharded on the batch dimension
    with a replicated kernel (a sharded kernel gives wrong results), so a
    sharded kernel is gathered, and so are inputs sharded on other
    dimensions. Gathering is differentiable: kernel gradients come back
    sharded like the kernel.

    Args:
        inputs: the convolution input.
        kernel: the convolution kernel.

    Returns:
        The pair `(inputs, kernel)`.
    """
    if isinstance(kernel, DTensor):
        mesh = kernel.device_mesh
        kernel = layouts.redistribute(kernel, mesh, [Replicate()] * mesh.ndim)
    if isinstance(inputs, DTensor):
        batch_only = [
            p if p.is_shard() and p.dim == 0 else Replicate()
            for p in inputs.placements
        ]
        inputs = layouts.redistribute(inputs, inputs.device_mesh, batch_only)
    return inputs, kernel


def reshape(x, newshape):
    """`torch.reshape`, on global values where DTensor refuses the view.

    Layer calls and steps compute refused ops on global values already
    (`fallback`); a reshape outside them, such as keras-hub's RWKV7 building
    its generation cache by calling its layers' `call` directly, splitting
    a dimension whose shards cut its pieces (a head split between 4
    processes), is computed the same way here. DTensor refuses before it
    communicates, so every process takes the same path.

    Args:
        x: a tensor.
        newshape: the new shape.

    Returns:
        `x` reshaped.
    """
    if runtime.current_distribution() is None or not isinstance(x, DTensor):
        return torch.reshape(x, newshape)
    try:
        return torch.reshape(x, newshape)
    except RuntimeError:
        with fallback.dtensor_fallback():
            return torch.reshape(x, newshape)


def local_einsum(function):
    """Runs `einsum` on each process' shards, as tensor parallelism does.

    An einsum is a sum of products: split along one label, each process
    computes its part on its shards. A label kept in the output (a batch
    row, an attention head) gives the output's shards: the query-key product
    and the weighted sum of values of head-sharded attention. A contracted
    label gives a partial sum: the attention output projection, row
    parallel over heads. On `DTensor`s, torch would compute an einsum
    through views merging such a label into a larger dimension (a strided
    shard, which the fallback gathers), so every process would compute all
    heads, and the projections' gradients would need an all-reduce. Here
    each mesh axis may shard one label, the same way in every operand that
    has it (operands without it replicated there); other layouts (two
    labels on one mesh axis, an operand replicated along the split label,
    a partial operand, uneven shards, an ellipsis, a plain operand) go to
    `function` as they are.

    Args:
        function: the backend's `einsum`.

    Returns:
        The wrapped function.
    """

    @functools.wraps(function)
    def einsum(subscripts, *operands, **kwargs):
        if runtime.current_distribution() is None:
            return function(subscripts, *operands, **kwargs)
        split = _shard_local_einsum(subscripts, operands)
        if split is None:
            return function(subscripts, *operands, **kwargs)
        mesh, placements, local_operands = split
        output = function(subscripts, *local_operands, **kwargs)
        return DTensor.from_local(output, mesh, placements, run_check=False)

    return einsum


def local_matmul(function):
    """Runs a batched `matmul` on each process' shards, as `local_einsum`.

    A product of stacks of matrices (`(batch, heads, i, j) @ (batch, heads,
    j, k)`) is the einsum `...ij,...jk->...ik`: split along a stacked
    dimension, each process multiplies its own matrices. On `DTensor`s
    torch merges the stacked dimensions into one first (a strided shard,
    which the fallback gathers): keras-hub's Qwen3.5 gated delta net
    gathered its heads for every step of its chunk loop.

    Args:
        function: the backend's `matmul`.

    Returns:
        The wrapped function.
    """

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
    """How a batched `matmul` splits into one per shard, or `None`: operands
    of one rank above 2 with the same stacked dimensions."""
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
    """How `einsum` splits into one per shard, or `None`.

    Returns:
        `(mesh, output placements, local operands)`.
    """
    if torch.compiler.is_compiling():
        # Compiled steps trace DTensor's own einsum, as before: dynamo
        # failed on this path in a compiled MultiHeadAttention step
        # (`InternalTorchDynamoError`, `tests/test_jit_compile.py`).
        return None
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
    placements = [_output_placement(label, output) for label in split_labels]
    local_operands = [
        _local_part(x, labels, split_labels)
        for labels, x in zip(inputs, operands)
    ]
    return mesh, placements, local_operands


def _output_placement(label, output):
    """A kept label's shards are the output's; a contracted label's sum to
    it."""
    if label is None:
        return Replicate()
    if label in output:
        return Shard(output.index(label))
    return Partial()


def _split_label(inputs, operands, mesh_dim, num_shards):
    """The one label sharded on `mesh_dim` (`None`: none, `False`: a layout
    that does not split: several labels, a partial sum, an uneven shard, an
    operand replicated along the label)."""
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


def _local_part(x, labels, split_labels):
    """This process' part of an einsum operand: its local tensor, whose
    gradient is a partial sum where the einsum splits on a label the
    operand lacks (each process' part of the output reads all of it)."""
    grad_placements = []
    for label in split_labels:
        if label is None:
            grad_placements.append(Replicate())
        elif label in labels:
            grad_placements.append(Shard(labels.index(label)))
        else:
            grad_placements.append(Partial())
    return x.to_local(grad_placements=grad_placements)


def einsum_operands(operands):
    """Lays out einsum operands the way DTensor can contract them.

    DTensor computes an einsum through views, which cannot keep a dimension
    sharded unevenly or a dimension of size 1 sharded (e.g. Gemma's single
    key/value head on a model axis of 1 or 2): such dimensions are gathered
    first. Gathering is differentiable:
    gradients come back sharded like the operand.

    Args:
        operands: the einsum operands.

    Returns:
        The operands, as a list.
    """
    return [_gather_uneven_dims(x) for x in operands]


def _gather_uneven_dims(x):
    if not isinstance(x, DTensor):
        return x
    mesh = x.device_mesh
    placements = [
        Replicate() if p.is_shard() and _uneven(x, p.dim, mesh.size(i)) else p
        for i, p in enumerate(x.placements)
    ]
    if placements == list(x.placements):
        return x
    return layouts.redistribute(x, mesh, placements)


def _uneven(x, dim, num_shards):
    # DTensor's views cannot keep a dimension of size 1 sharded either,
    # even over a mesh axis of size 1 (where gathering costs nothing).
    return x.shape[dim] % num_shards or x.shape[dim] == 1


def take_operands(x, indices):
    """Lays out `take` operands the way DTensor can look them up.

    A lookup in a table sharded on a mesh axis with indices sharded on the
    same axis (Llama's and Gemma's embeddings on a 2D mesh, ids sharded on
    the batch axis) leaves DTensor's masked partial sum with a mask of the
    wrong shape (`IndexError` when it is reduced). The indices are gathered
    along such axes: they are small.

    Args:
        x: the table.
        indices: the indices.

    Returns:
        The pair `(x, indices)`.
    """
    if not isinstance(x, DTensor) or not isinstance(indices, DTensor):
        return x, indices
    placements = [
        Replicate() if p.is_shard() and table.is_shard() else p
        for p, table in zip(indices.placements, x.placements)
    ]
    return x, layouts.redistribute(indices, indices.device_mesh, placements)


def dropout(inputs, rate):
    """`torch.nn.functional.dropout`, global for a `DTensor`.

    DTensor's own random ops draw per shard (and, on CPU meshes, from each
    process' generator). Here the noise of the whole tensor is drawn the way
    torch's dropout draws it, on every process, from the generator state of
    process 0 (broadcast first: processes may have been seeded differently),
    so all copies of the tensor agree and the result equals that of one
    process with the same torch seed.

    Args:
        inputs: a tensor.
        rate: the probability of dropping an element.

    Returns:
        The tensor with dropout applied.
    """
    if not isinstance(inputs, DTensor):
        return torch.nn.functional.dropout(inputs, p=rate, training=True)
    runtime.sync_torch_rng()
    noise = torch.empty(inputs.shape, dtype=inputs.dtype, device=inputs.device)
    noise.bernoulli_(1 - rate)
    noise.div_(1 - rate)
    return inputs * layouts.replicate(noise, inputs.device_mesh)


def local_attention(function):
    """Runs `dot_product_attention` on each process' shards of its operands.

    Attention is computed per batch row and per head, so operands sharded
    only on those dimensions are attended shard by shard, as tensor
    parallelism does, with no collective. On `DTensor`s DTensor would
    instead decompose the math kernel into views that it cannot shard
    under `torch.compile` (torch 2.13), and, eagerly, into strided shards
    that the fallback gathers: every process would attend every head. A
    mask or a bias (that needs no gradient) goes along when it is laid out
    like the scores it masks: its batch and head dimensions sharded as the
    query's, or of size 1 and replicated (a causal or padding mask
    broadcast over the heads). Upstream's flash attention probe
    (`SDPAParams`) is skipped there too: dynamo cannot trace it, and
    torch's own kernel choice takes the flash kernel first where it can
    run. Other operands (a partial or uneven layout, a mask laid out
    otherwise) go to `function` as they are.

    Args:
        function: the backend's `dot_product_attention`.

    Returns:
        The wrapped function.
    """

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
        output = function(
            query.to_local(), key.to_local(), value.to_local(), **kwargs
        )
        return DTensor.from_local(
            output, query.device_mesh, query.placements, run_check=False
        )

    return attention


def _shard_local_attention(query, key, value, args, kwargs):
    """Whether attention splits into one per shard: `DTensor` operands laid
    out alike, sharded evenly on batch (0) or heads (2) only, and a mask or
    bias laid out like the scores (see `local_attention`)."""
    if not all(isinstance(x, DTensor) for x in (query, key, value)):
        return False
    if args:
        return False
    mesh, placements = query.device_mesh, query.placements
    for x in (key, value):
        if x.device_mesh != mesh or x.placements != placements:
            return False
    for mesh_dim, placement in enumerate(placements):
        if placement.is_replicate():
            continue
        if not placement.is_shard() or placement.dim not in (0, 2):
            return False
        size = mesh.size(mesh_dim)
        if any(x.shape[placement.dim] % size for x in (query, key, value)):
            return False
    return all(
        _scores_like(kwargs.get(name), query) for name in ("mask", "bias")
    )


def _scores_like(mask, query):
    """Whether `mask` (absent, or broadcast to the scores' `(batch, heads,
    queries, keys)`) splits as the query `(batch, queries, heads, size)`
    does: each sharded dimension of the query sharded alike in the mask,
    or of size 1 there and replicated."""
    if mask is None:
        return True
    if not isinstance(mask, DTensor) or mask.requires_grad or mask.ndim != 4:
        return False
    if mask.device_mesh != query.device_mesh:
        return False
    # The query's batch (0) and heads (2) are the scores' 0 and 1.
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


def divide_no_nan_local(numerator, divisor):
    """`divide_no_nan` computed on each process' values where that is exact.

    A loss reduced over a sharded batch is a partial sum (each process
    holds its rows' share). `where(d == 0, 0, x / d)` is linear in `x`, so
    computed on each process' share it sums to the quotient of the whole:
    the quotient stays partial, to be reduced later with the gradients (see
    `step_reduction.reduce_with_loss`), with no look at the divisor's values and
    no collective. On `DTensor`s, `divide_no_nan`'s `where` would reduce it
    at once. A replicated numerator (a metric's total, divided by its
    count) is divided on the local values as well: the same numbers,
    without DTensor's dispatch of the four ops.

    Args:
        numerator: a tensor.
        divisor: a tensor.

    Returns:
        The quotient, a `DTensor` placed like `numerator`; `None` unless
        `numerator` is a `DTensor` partial (sum or average) or replicated
        on each mesh axis, and `divisor` is a constant replicated on the
        same mesh (or a plain tensor).
    """
    if not isinstance(numerator, DTensor) or divisor.requires_grad:
        return None
    placements = numerator.placements
    if not all(_is_linear_partial(p) or p.is_replicate() for p in placements):
        return None
    if isinstance(divisor, DTensor):
        if divisor.device_mesh != numerator.device_mesh or not all(
            p.is_replicate() for p in divisor.placements
        ):
            return None
        divisor = divisor.to_local()
    # Each share's gradient is the whole quotient's gradient.
    part = numerator.to_local(
        grad_placements=[
            Replicate() if p.is_partial() else p for p in placements
        ]
    )
    safe_divisor = torch.where(divisor == 0, torch.ones_like(divisor), divisor)
    quotient = torch.where(divisor == 0, 0, torch.divide(part, safe_divisor))
    return DTensor.from_local(
        quotient, numerator.device_mesh, placements, run_check=False
    )


def _is_linear_partial(placement):
    return placement.is_partial() and placement.reduce_op in ("sum", "avg")
