"""Tests of the multi-rank test harness itself (tests/harness.py).

The bodies below run in the worker processes: `body(rank, world_size,
*args)`. Tests that make a body fail also check that the pool is
recycled and that the next call works on fresh workers.
"""

import os
import sys
import textwrap
import time

import numpy as np
import pytest

from tests import harness
from tests.harness import MultiRankError
from tests.harness import run_on_ranks

# Short timeout of the deliberately stuck bodies; the ordinary ones keep
# the (long) default so that a loaded machine does not make them flake.
STUCK_TIMEOUT = 5


# --------------------------------------------------------------------------
# Bodies (run in the workers)
# --------------------------------------------------------------------------


def _identity_body(rank, world_size, tag):
    import torch.distributed as dist

    return {
        "rank": rank,
        "world_size": world_size,
        "dist_rank": dist.get_rank(),
        "dist_world_size": dist.get_world_size(),
        "tag": tag,
        "array": np.full((2,), rank, dtype=np.float32),
    }


def _all_reduce_body(rank, world_size, scale):
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([float(rank)])
    dist.all_reduce(tensor)
    return tensor.item() * scale


def _environment_body(rank, world_size):
    import torch
    import torch.distributed as dist

    names = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "KERAS_BACKEND",
    )
    return {
        "env": {name: os.environ.get(name) for name in names},
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
        "keras_imported": "keras" in sys.modules,
    }


def _raise_on_rank_1_body(rank, world_size):
    if rank == 1:
        raise ValueError(f"boom on rank {rank}")
    return "fine"


def _raise_on_rank_1_while_rank_0_waits_body(rank, world_size):
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise RuntimeError("rank 1 gives up before the collective")
    dist.all_reduce(torch.ones(1))  # Never completes: rank 1 is gone.


def _deadlock_body(rank, world_size):
    import torch
    import torch.distributed as dist

    if rank == 0:
        dist.all_reduce(torch.ones(1))  # Rank 1 never joins.
    return rank


def _exit_on_rank_1_body(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank


def _segfault_on_rank_0_body(rank, world_size):
    import ctypes

    if rank == 0:
        ctypes.string_at(0)  # Reads address 0: SIGSEGV.
    return rank


def _pid_body(rank, world_size):
    return os.getpid()


def _print_body(rank, world_size):
    print(f"hello from rank {rank}")
    return rank


def _unpicklable_result_body(rank, world_size):
    return lambda: rank


def _pollute_state_body(rank, world_size):
    import torch

    import keras

    torch.set_default_dtype(torch.float64)
    keras.config.set_floatx("float16")
    keras.distribution.set_distribution("leaked distribution")
    os.environ["MULTIRANK_LEAKED"] = "1"
    os.chdir("/")
    return torch.get_default_dtype() == torch.float64


def _read_state_body(rank, world_size):
    import torch

    import keras

    return {
        "torch_dtype": str(torch.get_default_dtype()),
        "floatx": keras.config.floatx(),
        "distribution": keras.distribution.distribution(),
        "leaked_env": "MULTIRANK_LEAKED" in os.environ,
        "cwd": os.getcwd(),
    }


# --------------------------------------------------------------------------
# Results and pool reuse
# --------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_returns_values_ordered_by_rank(world_size):
    results = run_on_ranks(
        _identity_body, world_size=world_size, kwargs={"tag": "t"}
    )

    assert [r["rank"] for r in results] == list(range(world_size))
    assert [r["dist_rank"] for r in results] == list(range(world_size))
    assert {r["world_size"] for r in results} == {world_size}
    assert {r["dist_world_size"] for r in results} == {world_size}
    assert {r["tag"] for r in results} == {"t"}
    for rank, result in enumerate(results):
        np.testing.assert_array_equal(result["array"], [rank, rank])


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_across_ranks(world_size):
    expected = sum(range(world_size)) * 10.0

    results = run_on_ranks(
        _all_reduce_body, world_size=world_size, kwargs={"scale": 10}
    )

    assert results == [expected] * world_size


@pytest.mark.parametrize("world_size", [2, 4])
def test_workers_look_like_torchrun_ranks(world_size):
    results = run_on_ranks(_environment_body, world_size=world_size)

    ports = {r["env"]["MASTER_PORT"] for r in results}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for rank, result in enumerate(results):
        env = result["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(world_size)
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["KERAS_BACKEND"] == "torch"
        assert result["threads"] == 1
        assert result["backend"] == "gloo"
        assert result["keras_imported"]


def test_pool_is_reused_between_calls():
    first = run_on_ranks(_pid_body, world_size=2)
    second = run_on_ranks(_pid_body, world_size=2)

    assert first == second == harness.pool_pids(2)
    assert os.getpid() not in first


def test_state_is_reset_after_a_successful_call():
    cwd = run_on_ranks(_read_state_body, world_size=2)[0]["cwd"]
    assert run_on_ranks(_pollute_state_body, world_size=2) == [True, True]

    state = run_on_ranks(_read_state_body, world_size=2)

    assert (
        state
        == [
            {
                "torch_dtype": "torch.float32",
                "floatx": "float32",
                "distribution": None,
                "leaked_env": False,
                "cwd": cwd,
            }
        ]
        * 2
    )


def test_worker_output_is_forwarded(capsys):
    run_on_ranks(_print_body, world_size=2)

    out = capsys.readouterr().out
    assert "[rank 0] hello from rank 0" in out
    assert "[rank 1] hello from rank 1" in out


def test_call_overhead_is_small():
    # A fresh pool, started outside the measurement: the harness' own
    # cost, not the `gc.collect()` of `clear_session` after whatever
    # models earlier tests left in a reused pool.
    harness.shutdown_pools()
    run_on_ranks(_pid_body, world_size=2)
    calls = 20

    start = time.monotonic()
    for _ in range(calls):
        run_on_ranks(_pid_body, world_size=2)
    per_call = (time.monotonic() - start) / calls

    print(f"per-call overhead, 2 ranks: {per_call * 1000:.1f} ms")
    assert per_call < 0.25


# --------------------------------------------------------------------------
# Failures
# --------------------------------------------------------------------------


def test_exception_on_one_rank_reports_every_rank():
    pids_before = harness.pool_pids(2)

    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_raise_on_rank_1_body, world_size=2)

    message = str(info.value)
    # A call stating no timeout is bounded by the default.
    assert f"(timeout {harness.DEFAULT_TIMEOUT:g} s)" in message
    assert "rank 0 ok" in message and "rank 1 raised" in message
    assert "===== rank 0: ok =====" in message
    assert "===== rank 1: error =====" in message
    assert "ValueError: boom on rank 1" in message
    assert "_raise_on_rank_1_body" in message  # The traceback's frame.
    assert [o.status for o in info.value.outcomes] == ["ok", "error"]
    # The pool was recycled and the next call runs on new workers.
    assert run_on_ranks(
        _all_reduce_body, world_size=2, kwargs={"scale": 1}
    ) == [1.0, 1.0]
    assert set(harness.pool_pids(2)).isdisjoint(pids_before)


def test_ranks_waiting_on_a_failed_rank_are_stopped_quickly():
    harness.pool_pids(2)  # Start the pool outside the measurement.
    timeout = 60

    start = time.monotonic()
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(
            _raise_on_rank_1_while_rank_0_waits_body,
            world_size=2,
            timeout=timeout,
        )
    elapsed = time.monotonic() - start

    message = str(info.value)
    assert [o.status for o in info.value.outcomes] == ["stopped", "error"]
    assert "RuntimeError: rank 1 gives up before the collective" in message
    assert "all_reduce" in message  # Rank 0's stack dump.
    assert elapsed < timeout / 2


def test_deadlock_times_out_with_stacks_and_pool_recovers():
    pids_before = harness.pool_pids(2)

    start = time.monotonic()
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_deadlock_body, world_size=2, timeout=STUCK_TIMEOUT)
    elapsed = time.monotonic() - start

    message = str(info.value)
    assert f"timeout {STUCK_TIMEOUT} s" in message
    assert "rank 0 timed out (stuck)" in message and "rank 1 ok" in message
    assert [o.status for o in info.value.outcomes] == ["timeout", "ok"]
    stuck_stack = info.value.outcomes[0].detail
    assert "all_reduce" in stuck_stack and "_deadlock_body" in stuck_stack
    assert STUCK_TIMEOUT <= elapsed < STUCK_TIMEOUT + 15
    # No worker of the stuck pool survives; a fresh pool takes over.
    for pid in pids_before:
        assert not _process_exists(pid)
    assert run_on_ranks(
        _all_reduce_body, world_size=2, kwargs={"scale": 2}
    ) == [2.0, 2.0]


def test_worker_exit_is_reported_with_its_code():
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_exit_on_rank_1_body, world_size=2)

    message = str(info.value)
    assert "rank 1 died" in message
    assert "exited with code 3" in message
    assert info.value.outcomes[0].status == "ok"
    assert run_on_ranks(_pid_body, world_size=2) == harness.pool_pids(2)


def test_segfault_is_reported_with_signal_and_stack():
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_segfault_on_rank_0_body, world_size=2)

    detail = info.value.outcomes[0].detail
    assert info.value.outcomes[0].status == "died"
    assert "SIGSEGV" in detail
    assert "_segfault_on_rank_0_body" in detail  # faulthandler's dump.


def test_unpicklable_result_is_reported():
    with pytest.raises(MultiRankError, match="could not be pickled"):
        run_on_ranks(_unpicklable_result_body, world_size=2)


def test_nested_functions_are_refused_before_sending():
    def nested(rank, world_size):
        return rank

    with pytest.raises(TypeError, match="module-level function"):
        run_on_ranks(nested, world_size=2)


def test_every_call_is_bounded():
    for timeout in (None, 0, -1, float("inf"), "10"):
        with pytest.raises(ValueError, match="positive, finite number"):
            run_on_ranks(_pid_body, world_size=2, timeout=timeout)


def test_shutdown_destroys_groups_and_exits_cleanly(capsys):
    harness.pool_pids(2)
    procs = list(harness._POOLS[2]._procs)

    harness.shutdown_pools()

    assert [proc.exitcode for proc in procs] == [0, 0]
    assert "terminate called" not in capsys.readouterr().out
    assert 2 not in harness._POOLS


# --------------------------------------------------------------------------
# run_torchrun
# --------------------------------------------------------------------------

_TORCHRUN_SCRIPT = """
import os, sys, time

mode = sys.argv[1]
if mode == "hang":
    # Before the slow imports: the timeout only has to cover the start.
    if os.environ["RANK"] == "0":
        with open(sys.argv[2], "w") as f:
            f.write(str(os.getpid()))
    time.sleep(600)
if mode == "fail" and os.environ["RANK"] == "1":
    raise RuntimeError("torchrun rank 1 failed on purpose")

import torch, torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"rank {rank}: sum={t.item()} backend={os.environ['KERAS_BACKEND']}")
dist.destroy_process_group()
"""


@pytest.fixture
def torchrun_script(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(_TORCHRUN_SCRIPT))
    return path


def test_run_torchrun_success(torchrun_script):
    result = harness.run_torchrun(torchrun_script, nproc=2, args=["ok"])

    assert result.returncode == 0
    assert "rank 0: sum=3.0 backend=torch" in result.stdout
    assert "rank 1: sum=3.0 backend=torch" in result.stdout


def test_run_torchrun_failure_shows_output_tail(torchrun_script):
    with pytest.raises(AssertionError) as info:
        harness.run_torchrun(
            torchrun_script, nproc=2, args=["fail"], timeout=120
        )

    assert "torchrun rank 1 failed on purpose" in str(info.value)


def test_run_torchrun_timeout_kills_the_whole_tree(torchrun_script, tmp_path):
    pid_file = tmp_path / "hanging.pid"

    # The ranks hang before importing torch: the timeout covers torchrun's
    # start and a Python start-up.
    with pytest.raises(AssertionError, match="timed out after 12 s") as info:
        harness.run_torchrun(
            torchrun_script, nproc=2, args=["hang", pid_file], timeout=12
        )

    assert pid_file.exists(), str(info.value)  # Rank 0 was started.
    assert not _process_exists(int(pid_file.read_text()))
    assert "script.py" in str(info.value)  # Its faulthandler stack dump.


def _process_exists(pid):
    """True if `pid` is a live process (zombies count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
