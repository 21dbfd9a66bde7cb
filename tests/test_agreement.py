"""Processes compare what they are about to do, in one small collective.

`agreement` and `collectives.all_gather_ints` on 2 gloo ranks, called
directly (no `keras.distribution` set): the lowest layer under the
"different models" and "different numbers of batches" errors.
"""

from tests.harness import run_on_ranks


def _gather_ints_body(rank, world_size):
    from keras.src.backend.torch.distributed.core import collectives

    return collectives.all_gather_ints([rank, 10 + rank], None)


def test_all_gather_ints_gives_every_process_all_values():
    results = run_on_ranks(_gather_ints_body, world_size=2)
    assert results == [[[0, 10], [1, 11]]] * 2


def _check_variable_body(rank, world_size, differ):
    from keras.src.backend.torch.distributed.health import agreement

    shape = (2, 3 + rank) if differ else (2, 3)
    try:
        agreement.check_same_variable("seq/dense/kernel", shape, "float32")
    except ValueError as e:
        return str(e)
    return None


def test_same_variables_pass_without_a_message():
    results = run_on_ranks(_check_variable_body, world_size=2, args=(False,))
    assert results == [None, None]


def test_different_variables_raise_the_same_error_on_every_process():
    messages = run_on_ranks(_check_variable_body, world_size=2, args=(True,))
    assert messages[0] == messages[1]
    assert "different models" in messages[0]
    assert "'seq/dense/kernel' (shape (2, 3)" in messages[0]
    assert "process 1 creates 'seq/dense/kernel' (shape (2, 4)" in (messages[0])


def _unreachable_store_body(rank, world_size):
    from keras.src.backend.torch.distributed.health import call_agreement
    from keras.src.backend.torch.distributed.health import health

    if rank == 0:
        return None

    def refused():
        raise ConnectionRefusedError("connection refused")

    # The pool's workers run other tests: what is changed here is restored
    # (a failed start changes nothing else).
    job_store, health._job_store = health._job_store, refused
    tried, call_agreement._state["tried"] = call_agreement._state["tried"], None
    try:
        call_agreement.start()
    except RuntimeError as e:
        return str(e)
    finally:
        health._job_store = job_store
        call_agreement._state["tried"] = tried
    return None


def test_a_process_that_cannot_reach_the_store_raises():
    # Else it alone would skip the agreement the others wait for in it.
    results = run_on_ranks(_unreachable_store_body, world_size=2)
    assert results[0] is None, results
    assert "cannot reach the job's store (connection refused)" in results[1]
