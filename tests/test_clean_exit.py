"""A job that ends well exits 0 on every rank.

gloo's worker threads outlive `destroy_process_group` while a device mesh
holds its groups, and one of them that drops a tensor once the interpreter
is shutting down aborts the process (pytorch#190489): the training went
well and torchrun still reports a failure. `keras.distribution` tears the
groups down at exit (`runtime._destroy_process_group`); this test exits
right after many collectives, a few times over, since the abort is a race.
"""

from pathlib import Path

from tests.harness import run_torchrun

SCRIPT = Path(__file__).with_name("exit_scenario.py")
# Without the clean-up about 1 exit in 3 aborts (`exit_scenario.py`): five
# exits miss a regression about 1 time in 8.
EXITS = 5


def test_every_rank_exits_0_after_its_last_collectives():
    for attempt in range(EXITS):
        result = run_torchrun(
            SCRIPT,
            nproc=2,
            timeout=120,
            env={"CUDA_VISIBLE_DEVICES": ""},
            check=False,
        )
        assert result.returncode == 0, (
            f"exit {attempt + 1} of {EXITS} failed:\n"
            f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        )
        assert result.stdout.count("returns") == 2, result.stdout


def test_a_script_that_destroys_its_process_group_exits_cleanly():
    # The processes' announcement at exit read the rank from the group.
    result = run_torchrun(
        SCRIPT,
        nproc=2,
        args=["--user-destroys"],
        timeout=120,
        env={"CUDA_VISIBLE_DEVICES": ""},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("returns") == 2, result.stdout
    assert "Exception ignored" not in result.stderr, result.stderr[-4000:]
