"""Ops linear in an operand, run on its partial sums (`linear_partials`).

Each case builds a partial sum from per-process terms that every process
can compute (seeded by process), runs one op on `DTensor`s under the step's
dispatch mode, and compares the result's global value with the op run on
the summed value as one process runs it, and counts the collectives.
"""

import numpy as np
import torch

from tests.harness import run_on_ranks


def _terms(shape, world_size, seed):
    """One term per process of a partial sum, and their sum."""
    terms = [
        torch.Generator().manual_seed(seed * 100 + r) for r in range(world_size)
    ]
    terms = [torch.randn(shape, generator=g) for g in terms]
    return terms, sum(terms)


def _kind(placement):
    if placement.is_partial():
        return "partial"
    if placement.is_shard():
        return f"shard {placement.dim}"
    return "replicate"


def _cases_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from keras.src.backend.torch.distributed.dtensor_gaps import fallback

    aten = torch.ops.aten
    if world_size == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("b", "m"))
        model_axis, model_rank = 1, mesh.get_local_rank(1)
        # Rows split over the batch axis, partial over the model axis.
        partial, whole = [Shard(0), Partial()], [Shard(0), Replicate()]
    else:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("m",))
        model_axis, model_rank = 0, rank
        partial, whole = [Partial()], [Replicate()]
    size = mesh.size(model_axis)

    def partial_sum(shape, seed):
        terms, value = _terms(shape, size, seed)
        # This process' rows of its term (the rows the batch axis gives it).
        rows = terms[model_rank]
        if world_size == 4:
            rows = rows.chunk(2, dim=0)[mesh.get_local_rank(0)]
        return (
            DTensor.from_local(rows, mesh, partial, run_check=False),
            value,
        )

    def replicated(value):
        return distribute_tensor(value, mesh, whole)

    results = {}

    def run(name, func, args, plain_args, placements=None):
        with CommDebugMode() as comm, fallback.dtensor_fallback():
            out = func(*args)
        expected = func(*plain_args)
        results[name] = (
            out.full_tensor().numpy(),
            expected.numpy(),
            comm.get_total_counts(),
            [_kind(p) for p in out.placements],
        )

    logits = torch.randn(8, 5, generator=torch.Generator().manual_seed(7))
    softmax = torch.softmax(logits, -1)
    log_softmax = torch.log_softmax(logits, -1)
    grad, grad_value = partial_sum((8, 5), seed=1)
    run(
        "softmax_backward",
        aten._softmax_backward_data.default,
        (grad, replicated(softmax), 1, torch.float32),
        (grad_value, softmax, 1, torch.float32),
    )
    run(
        "log_softmax_backward",
        aten._log_softmax_backward_data.default,
        (grad, replicated(log_softmax), -1, torch.float32),
        (grad_value, log_softmax, -1, torch.float32),
    )
    # The backward of a top-2: a partial gradient scattered into zeros.
    index = torch.topk(logits, 2, dim=1).indices
    src, src_value = partial_sum((8, 2), seed=2)
    zeros = torch.zeros(8, 5)
    run(
        "scatter_into_zeros",
        aten.scatter.src,
        (replicated(zeros), 1, replicated(index), src),
        (zeros, 1, index, src_value),
    )
    # `self` replicated on every axis, the others' rows split: it takes
    # its rows.
    everywhere = [Replicate()] * mesh.ndim
    run(
        "scatter_into_whole_zeros",
        aten.scatter.src,
        (distribute_tensor(zeros, mesh, everywhere), 1, replicated(index), src),
        (zeros, 1, index, src_value),
    )
    # A replicated `self` enters the sum once, not once per process.
    base = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    run(
        "scatter_into_values",
        aten.scatter.src,
        (replicated(base), 1, replicated(index), src),
        (base, 1, index, src_value),
    )
    # A partial sum plus a shard (over the same axis): the shard, in zeros,
    # joins this process' term.
    columns = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    split = list(whole)
    split[model_axis] = Shard(1)
    run(
        "partial_plus_shard",
        aten.add.Tensor,
        (grad, distribute_tensor(columns, mesh, split)),
        (grad_value, columns),
    )
    run(
        "shard_plus_partial",
        aten.add.Tensor,
        (distribute_tensor(columns, mesh, split), grad),
        (columns, grad_value),
    )
    # An average over processes plus a shard is not a partial sum of the
    # two: DTensor adds them (a batch normalization's moving mean, its
    # batch mean an average over the batch axis, the variable sharded).
    mean_terms, _ = _terms((8, 5), size, seed=4)
    local_mean = mean_terms[model_rank]
    mean_placements = list(partial)
    mean_placements[model_axis] = Partial("avg")
    if world_size == 4:
        local_mean = local_mean.chunk(2, dim=0)[mesh.get_local_rank(0)]
    mean = DTensor.from_local(
        local_mean, mesh, mean_placements, run_check=False
    )
    run(
        "average_plus_shard",
        aten.add.Tensor,
        (distribute_tensor(columns, mesh, split), mean),
        (columns, sum(mean_terms) / size),
    )
    # Not linear in the softmax output: DTensor computes it (reducing the
    # partial output first).
    output, output_value = partial_sum((8, 5), seed=3)
    run(
        "partial_output",
        aten._softmax_backward_data.default,
        (replicated(grad_value), output, 1, torch.float32),
        (grad_value, output_value, 1, torch.float32),
    )
    return results


def _check(per_rank, world_size):
    for results in per_rank:
        for name, (out, expected, collectives, placements) in results.items():
            np.testing.assert_allclose(
                out, expected, rtol=1e-6, atol=1e-6, err_msg=name
            )
            if name in ("partial_output", "average_plus_shard"):
                assert collectives >= 1, name
                assert "partial" not in placements, name
                continue
            assert collectives == 0, (name, collectives)
            assert placements[-1] == "partial", (name, placements)
            if world_size == 4:
                assert placements[0] == "shard 0", (name, placements)


def test_linear_ops_keep_a_partial_sum_partial():
    _check(run_on_ranks(_cases_body, world_size=2), 2)


def test_linear_ops_keep_a_partial_sum_partial_beside_split_rows():
    _check(run_on_ranks(_cases_body, world_size=4), 4)
