"""`divide_no_nan` of a partial sum stays partial, on 2 gloo ranks.

`ops.divide_no_nan_local` called directly on DTensors built by hand (no
`keras.distribution` set): each process divides its share, and the shares
sum to the quotient of the whole. Through a train step:
`tests/test_step_collectives.py`.
"""

import torch

from keras.src.backend.torch.distributed.dtensor_gaps import ops
from tests.harness import run_on_ranks


def _divide_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate

    from keras.src.backend.torch.distributed.dtensor_gaps import ops

    mesh = init_device_mesh("cpu", (world_size,))
    # Process 0 holds [1, 2, 3], process 1 [2, 2, 3]: the sum is [3, 4, 6].
    share = torch.tensor([1.0 + rank, 2.0, 3.0])
    numerator = DTensor.from_local(share, mesh, [Partial()])
    divisor = torch.tensor([2.0, 0.0, 3.0])
    quotient = ops.divide_no_nan_local(numerator, divisor)
    replicated = DTensor.from_local(divisor, mesh, [Replicate()])
    from_dtensor = ops.divide_no_nan_local(numerator, replicated)
    return {
        "partial": [p.is_partial() for p in quotient.placements],
        "local": quotient.to_local().tolist(),
        "whole": quotient.full_tensor().tolist(),
        "same_with_a_replicated_divisor": (
            from_dtensor.full_tensor().tolist()
            == quotient.full_tensor().tolist()
        ),
    }


def test_partial_numerator_is_divided_share_by_share():
    results = run_on_ranks(_divide_body, world_size=2)
    assert results[0]["whole"] == results[1]["whole"] == [1.5, 0.0, 2.0]
    assert results[0]["local"] == [0.5, 0.0, 1.0]
    assert results[1]["local"] == [1.0, 0.0, 1.0]
    assert all(r["partial"] == [True] for r in results)
    assert all(r["same_with_a_replicated_divisor"] for r in results)


def test_plain_tensors_are_left_to_upstream():
    divisor = torch.tensor([2.0, 0.0])
    assert ops.divide_no_nan_local(torch.tensor([1.0, 1.0]), divisor) is None
