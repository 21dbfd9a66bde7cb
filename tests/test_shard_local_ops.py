"""Einsum, convolutions and attention run on each process' shards where they
split.

`local_einsum`, `local_matmul`, `local_conv` and `local_attention`
(`distributed/tensor_parallel/shard_local.py`). Each case computes the
torch backend's `einsum`, `matmul`, `conv` or `dot_product_attention` on
`DTensor` operands laid out on a gloo mesh, forward and backward, and
returns global values, which the parent compares with the op on plain
tensors in one process.
Where the einsum splits along one label per mesh axis (attention heads,
batch rows, a contracted head axis), or attention along batch rows or
heads with a mask laid out like its scores, the forward pass issues no
collective and the output is sharded (or a partial sum) along that label;
other layouts go to DTensor, with the same numbers.
"""

import numpy as np
import pytest
import torch

from tests.harness import run_on_ranks

# name -> (equation, operand shapes, operand placements per mesh axis:
# "r" replicated, an int a sharded dimension; mesh shape; expected output
# placements, or None where the einsum goes to DTensor).
CASES = {
    "heads_scores": (
        "bqnh,bknh->bnqk",
        ((2, 3, 4, 5), (2, 6, 4, 5)),
        ((2,), (2,)),
        (2,),
        ["S(1)"],
    ),
    "heads_values": (
        "bnqk,bknh->bqnh",
        ((2, 4, 3, 6), (2, 6, 4, 5)),
        ((1,), (2,)),
        (2,),
        ["S(2)"],
    ),
    "row_parallel_over_heads": (
        "bqnh,nhm->bqm",
        ((2, 3, 4, 5), (4, 5, 7)),
        ((2,), (0,)),
        (2,),
        ["P(sum)"],
    ),
    "column_parallel_replicated_input": (
        "btd,dnh->btnh",
        ((2, 3, 6), (6, 4, 5)),
        (("r",), (1,)),
        (2,),
        ["S(2)"],
    ),
    "operand_replicated_along_the_label_goes_to_dtensor": (
        "bqnh,bknh->bnqk",
        ((2, 3, 4, 5), (2, 6, 4, 5)),
        ((2,), ("r",)),
        (2,),
        None,
    ),
    "uneven_heads_go_to_dtensor": (
        "bqnh,bknh->bnqk",
        ((2, 3, 3, 5), (2, 6, 3, 5)),
        ((2,), (2,)),
        (2,),
        None,
    ),
    "two_labels_on_one_axis_go_to_dtensor": (
        "bqnh,bknh->bnqk",
        ((2, 4, 4, 5), (2, 6, 4, 5)),
        ((1,), (2,)),
        (2,),
        None,
    ),
    "batch_and_heads_on_a_2x2_mesh": (
        "bqnh,bknh->bnqk",
        ((2, 3, 4, 5), (2, 6, 4, 5)),
        ((0, 2), (0, 2)),
        (2, 2),
        ["S(0)", "S(1)"],
    ),
    # `matmul` of stacks of matrices: the einsum `...ij,...jk->...ik`.
    "matmul_stacked_heads": (
        "matmul",
        ((2, 4, 3, 5), (2, 4, 5, 6)),
        ((1,), (1,)),
        (2,),
        ["S(1)"],
    ),
    "matmul_contracted_dimension": (
        "matmul",
        ((2, 3, 4), (2, 4, 5)),
        ((2,), (1,)),
        (2,),
        ["P(sum)"],
    ),
    "matmul_of_stacks_split_apart_goes_to_dtensor": (
        "matmul",
        ((2, 4, 3, 5), (2, 4, 5, 6)),
        ((0,), (1,)),
        (2,),
        None,
    ),
    # A convolution (the backend's `conv`, "same" padding, channels last)
    # splits like a product over its channels.
    "conv_output_channels": (
        "conv",
        ((2, 5, 5, 4), (3, 3, 4, 6)),
        (("r",), (3,)),
        (2,),
        ["S(3)"],
    ),
    "conv_input_channels_contracted": (
        "conv",
        ((2, 5, 5, 4), (3, 3, 4, 6)),
        ((3,), (2,)),
        (2,),
        ["P(sum)"],
    ),
    "conv_batch_and_output_channels_on_a_2x2_mesh": (
        "conv",
        ((2, 5, 5, 4), (3, 3, 4, 6)),
        ((0, "r"), ("r", 3)),
        (2, 2),
        ["S(0)", "S(3)"],
    ),
    "conv_kernel_sharded_on_its_window_goes_to_dtensor": (
        "conv",
        ((2, 5, 5, 4), (4, 3, 4, 6)),
        (("r",), (0,)),
        (2,),
        None,
    ),
    "batch_and_contracted_heads_on_a_2x2_mesh": (
        "bqnh,nhm->bqm",
        ((2, 3, 4, 5), (4, 5, 7)),
        ((0, 2), ("r", 0)),
        (2, 2),
        ["S(0)", "P(sum)"],
    ),
}


def _backend_ops(name):
    """The torch backend's `numpy` or `nn` module (moved under `ops/` on
    Keras master)."""
    import importlib

    try:
        return importlib.import_module(f"keras.src.backend.torch.ops.{name}")
    except ImportError:
        return importlib.import_module(f"keras.src.backend.torch.{name}")


def _operands(shapes):
    return [
        torch.linspace(-1.0, 1.0, int(np.prod(shape))).reshape(shape).sin()
        * (i + 1)
        for i, shape in enumerate(shapes)
    ]


def _weights(shape):
    """Fixed output weights, so that every output element's gradient
    differs."""
    return torch.linspace(0.5, 1.5, int(np.prod(shape))).reshape(shape)


def _compute(module, equation, operands):
    """`module.einsum(equation, ...)`, `module.matmul` for "matmul", or the
    backend's `conv` ("same" padding) for "conv"."""
    if equation == "conv":
        return _backend_ops("nn").conv(*operands, padding="same")
    if equation == "matmul":
        return module.matmul(*operands)
    return module.einsum(equation, *operands)


def _set_a_distribution():
    """The shard-local paths run only while a distribution is set."""
    import keras

    keras.distribution.set_distribution(keras.distribution.DataParallel())


def _einsum_body(rank, world_size, name):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    torch_numpy = _backend_ops("numpy")
    _set_a_distribution()
    equation, shapes, layouts, mesh_shape, _ = CASES[name]
    mesh = init_device_mesh("cpu", mesh_shape)
    operands = []
    for x, layout in zip(_operands(shapes), layouts):
        placements = [Replicate() if p == "r" else Shard(p) for p in layout]
        operands.append(distribute_tensor(x, mesh, placements))
        operands[-1].requires_grad_()
    comm = CommDebugMode()
    with comm:
        y = _compute(torch_numpy, equation, operands)
    forward_collectives = comm.get_total_counts()
    weights = distribute_tensor(
        _weights(y.shape), mesh, [Replicate()] * mesh.ndim
    )
    (y * weights).sum().backward()
    return {
        "y": y.detach().full_tensor().numpy(),
        "placements": [str(p) for p in y.placements],
        "forward_collectives": forward_collectives,
        "grads": [x.grad.full_tensor().numpy() for x in operands],
        "grad_placements": [
            [str(p) for p in x.grad.placements] for x in operands
        ],
        "operand_placements": [
            [str(p) for p in x.placements] for x in operands
        ],
    }


@pytest.mark.parametrize("name", sorted(CASES))
def test_einsum_on_shards_equals_one_process(name):
    equation, shapes, _, mesh_shape, expected = CASES[name]
    operands = [x.requires_grad_() for x in _operands(shapes)]
    y = _compute(torch, equation, operands)
    (y * _weights(y.shape)).sum().backward()
    per_rank = run_on_ranks(
        _einsum_body,
        world_size=int(np.prod(mesh_shape)),
        kwargs={"name": name},
    )
    for result in per_rank:
        np.testing.assert_allclose(
            result["y"], y.detach().numpy(), rtol=1e-5, atol=1e-6
        )
        for grad, x in zip(result["grads"], operands):
            np.testing.assert_allclose(
                grad, x.grad.numpy(), rtol=1e-5, atol=1e-6
            )
        if expected is not None:
            # Split on the shards: laid out along the label, no collective,
            # and each sharded operand's gradient sharded like it (a
            # replicated one's is a partial sum where the einsum splits on
            # a label it lacks).
            assert result["placements"] == expected
            assert result["forward_collectives"] == 0
            for grad, operand in zip(
                result["grad_placements"], result["operand_placements"]
            ):
                for g, p in zip(grad, operand):
                    assert g == p or (p == "R" and g in ("R", "P(sum)"))
        else:
            # DTensor gathers or redistributes first.
            assert result["forward_collectives"] > 0


# name -> (query placements per mesh axis, mask shape, mask placements,
# expected output placements or None where attention goes to DTensor).
ATTENTION_CASES = {
    "heads_with_a_broadcast_mask": ((2,), (2, 1, 4, 4), ("r",), ["S(2)"]),
    "batch_with_a_mask_sharded_alike": ((0,), (2, 1, 4, 4), (0,), ["S(0)"]),
    "heads_with_a_mask_per_head": ((2,), (2, 4, 4, 4), (1,), ["S(2)"]),
    "heads_with_one_whole_key_value_head": (
        (2,),
        (2, 1, 4, 4),
        ("r",),
        ["S(2)"],
    ),
    "heads_with_two_whole_key_value_heads": (
        (2,),
        (2, 1, 4, 4),
        ("r",),
        ["S(2)"],
    ),
}
# Grouped-query cases: name -> (key/value heads, their placements). Replicated
# while the query's 4 heads are split: each process attends its 2 query
# heads with the key/value head(s) they read.
KEY_VALUE_HEADS = {
    "heads_with_one_whole_key_value_head": (1, ("r",)),
    "heads_with_two_whole_key_value_heads": (2, ("r",)),
}
# Masks laid out otherwise than the scores they mask: attention goes to
# DTensor (not run here: inside a layer call the fallback computes it).
MISMATCHED_MASKS = {
    "replicated_over_sharded_heads": ((2,), (2, 4, 4, 4), ("r",)),
    "sharded_on_batch_under_sharded_heads": ((2,), (2, 1, 4, 4), (0,)),
    "replicated_under_sharded_batch": ((0,), (2, 1, 4, 4), ("r",)),
}


def _attention_operands(mask_shape, key_heads=4):
    key_shape = (2, 4, key_heads, 3)
    q, k, v = _operands(((2, 4, 4, 3), key_shape, key_shape))
    # A causal mask with one padded key in the second row.
    mask = torch.ones(mask_shape, dtype=torch.bool).tril()
    mask[1, ..., 0] = False
    mask[1, ..., 0, 0] = True
    return q, k, v, mask


def _attention_body(rank, world_size, name):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from keras.src.backend.torch.distributed.dtensor_gaps import fallback

    torch_nn = _backend_ops("nn")

    _set_a_distribution()
    layout, mask_shape, mask_layout = ATTENTION_CASES[name][:3]
    key_heads, key_layout = KEY_VALUE_HEADS.get(name, (4, layout))
    mesh = init_device_mesh("cpu", (2,))
    *qkv, mask = _attention_operands(mask_shape, key_heads)

    def placements(layout):
        return [Replicate() if p == "r" else Shard(p) for p in layout]

    qkv = [
        distribute_tensor(x, mesh, placements(own)).requires_grad_()
        for x, own in zip(qkv, (layout, key_layout, key_layout))
    ]
    mask = distribute_tensor(mask, mesh, placements(mask_layout))
    comm = CommDebugMode()
    # As in a layer call: what DTensor refuses is computed on global values.
    with fallback.dtensor_fallback():
        with comm:
            y = torch_nn.dot_product_attention(*qkv, mask=mask)
        forward_collectives = comm.get_total_counts()
        weights = distribute_tensor(_weights(y.shape), mesh, [Replicate()])
        (y * weights).sum().backward()
    return {
        "y": y.detach().full_tensor().numpy(),
        "placements": [str(p) for p in y.placements],
        "forward_collectives": forward_collectives,
        "grads": [x.grad.full_tensor().numpy() for x in qkv],
    }


@pytest.mark.parametrize("name", sorted(ATTENTION_CASES))
def test_attention_on_shards_equals_one_process(name):
    torch_nn = _backend_ops("nn")
    _, mask_shape, _, expected = ATTENTION_CASES[name]
    key_heads = KEY_VALUE_HEADS.get(name, (4,))[0]
    *qkv, mask = _attention_operands(mask_shape, key_heads)
    qkv = [x.requires_grad_() for x in qkv]
    y = torch_nn.dot_product_attention(*qkv, mask=mask)
    (y * _weights(y.shape)).sum().backward()
    for result in run_on_ranks(
        _attention_body, world_size=2, kwargs={"name": name}
    ):
        np.testing.assert_allclose(
            result["y"], y.detach().numpy(), rtol=1e-5, atol=1e-6
        )
        for grad, x in zip(result["grads"], qkv):
            np.testing.assert_allclose(
                grad, x.grad.numpy(), rtol=1e-5, atol=1e-5
            )
        assert result["placements"] == expected
        assert result["forward_collectives"] == 0


def _mismatched_mask_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    from keras.src.backend.torch.distributed.tensor_parallel import shard_local

    mesh = init_device_mesh("cpu", (2,))
    splits = {}
    for name, (layout, mask_shape, mask_layout) in MISMATCHED_MASKS.items():
        *qkv, mask = _attention_operands(mask_shape)
        qkv = [distribute_tensor(x, mesh, [Shard(layout[0])]) for x in qkv]
        placement = Replicate() if mask_layout[0] == "r" else Shard(0)
        mask = distribute_tensor(mask, mesh, [placement])
        splits[name] = shard_local._shard_local_attention(
            *qkv, (), {"mask": mask}
        )
    return splits


def test_attention_with_a_mask_laid_out_otherwise_goes_to_dtensor():
    for splits in run_on_ranks(_mismatched_mask_body, world_size=2):
        assert splits == {name: False for name in MISMATCHED_MASKS}
