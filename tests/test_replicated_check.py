"""Plain tensors a layer call takes as replicated must agree everywhere.

`layer_call.check_replicated` called directly on 2 gloo ranks (no
`keras.distribution` set): equal values pass; a value that differs on a
process is named, with its path and shape, on every process. Through layer
calls: `tests/test_distribution_core.py`.
"""

from tests.harness import run_on_ranks


def _check_body(rank, world_size, differ):
    import torch

    from keras.src.backend.torch.distributed.training import layer_call

    values = {
        "mask": torch.ones(2, 3),
        "ids": torch.arange(4) + (rank if differ else 0),
        "note": "not a tensor",
    }
    try:
        layer_call.check_replicated(values, "input")
    except ValueError as e:
        return str(e)
    return None


def test_equal_plain_tensors_pass():
    assert run_on_ranks(_check_body, world_size=2, args=(False,)) == [
        None,
        None,
    ]


def test_a_differing_tensor_is_named_on_every_process():
    messages = run_on_ranks(_check_body, world_size=2, args=(True,))
    assert messages[0] == messages[1]
    assert "The input at ('ids',) (shape (4,))" in messages[0]
    assert "differs on processes [1] from process 0" in messages[0]
