"""A job that goes wrong ends on every live process, in bounded time, clearly.

Each scenario of `tests/job_scenarios.py` runs as two processes started
the way two machines would start them (no torchrun agent to kill the
survivor), with a rendezvous store owned by this test. All scenarios run
at once (they are independent), each bounded by its own deadline; the
tests then check, per scenario, that every live process exited non-zero
within its bound and said what went wrong.
"""

import datetime
import os
import subprocess
import sys
import time

import pytest

from tests import harness

SCRIPT = os.path.join(os.path.dirname(__file__), "job_scenarios.py")
# Bounds of collectives in the scenarios: short, so that a frozen peer is
# noticed quickly; the start bound covers imports on a loaded machine.
STEP_TIMEOUT = 5
START_TIMEOUT = 90
# Whole scenario, start-up included, on a loaded 2-core machine.
SCENARIO_BOUND = 150
# From process 1's misbehaviour to process 0's exit. A frozen peer: the
# step bound, the wait for the others' reports, exit; the issue asks for
# 90 s with a 30 s bound. A failed peer: the issue asks for 30 s.
FROZEN_BOUND = STEP_TIMEOUT + 5 + 20
FAILED_BOUND = 30

# scenario -> (process -> substrings of its stderr), for the processes that
# must exit non-zero.
_EXPECTED = {
    "freeze": {
        0: [
            "JobFailedError",
            "Train step 4 timed out",
            "collective",
            f"waited more than {STEP_TIMEOUT:g} s",
            "KERAS_DISTRIBUTION_TIMEOUT",
            "Process 1 of 2 did not arrive",
        ],
    },
    "die": {
        0: [
            "JobFailedError",
            "Process 1 of 2 failed or left",
            "train step",
            # Said before the wait for its report, which a launcher may cut.
            "no report yet from process 1 of 2, which may have failed",
        ],
    },
    "raise": {
        0: [
            "JobFailedError",
            "Process 1 of 2 failed or left during train step",
            "ValueError: boom from a callback on process 1",
            "Read the log of process 1",
        ],
        1: ["ValueError: boom from a callback on process 1"],
    },
}


class _Scenario:
    """The two processes of one scenario and what became of them."""

    def __init__(self, name, tmp_path):
        from torch.distributed import TCPStore

        self.name = name
        self.mark_file = str(tmp_path / f"{name}.mark")
        # Owned here, like a launcher's store: port 0, picked by the kernel.
        self.store = TCPStore(
            "127.0.0.1",
            0,
            None,
            True,
            datetime.timedelta(seconds=SCENARIO_BOUND),
            wait_for_workers=False,
        )
        self.started = time.time()
        self.procs = [self._start(rank) for rank in (0, 1)]
        self.ended = [None, None]
        self.stderr = ["", ""]

    def _start(self, rank):
        env = harness._torchrun_env(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self.store.port),
                # The processes are clients of our store, as under torchrun.
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "KERAS_DISTRIBUTION_TIMEOUT": str(STEP_TIMEOUT),
                "KERAS_DISTRIBUTION_START_TIMEOUT": str(START_TIMEOUT),
            }
        )
        return subprocess.Popen(
            [sys.executable, SCRIPT, self.name, self.mark_file],
            stdout=subprocess.DEVNULL,
            stderr=open(f"{self.mark_file}.{rank}.err", "w"),
            env=env,
            start_new_session=True,
        )

    def poll(self):
        for rank, proc in enumerate(self.procs):
            if self.ended[rank] is None and proc.poll() is not None:
                self.ended[rank] = time.time()

    def finish(self):
        """Kills what still runs (a frozen process); reads the logs."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for rank in (0, 1):
            with open(f"{self.mark_file}.{rank}.err") as f:
                self.stderr[rank] = f.read()

    def misbehaved_at(self):
        with open(self.mark_file) as f:
            return float(f.read())


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("scenarios")
    running = {name: _Scenario(name, tmp_path) for name in _EXPECTED}
    deadline = time.time() + SCENARIO_BOUND
    while time.time() < deadline:
        for scenario in running.values():
            scenario.poll()
        # A frozen process never ends: wait for the live ones only.
        if all(
            s.ended[r] is not None
            for s in running.values()
            for r in _live_processes(s.name)
        ):
            break
        time.sleep(0.2)
    for scenario in running.values():
        scenario.finish()
        took = [
            None if t is None else round(t - scenario.started, 1)
            for t in scenario.ended
        ]
        print(f"{scenario.name}: processes ended after {took} s")
    return running


def _live_processes(name):
    return (0,) if name == "freeze" else (0, 1)


def _failure(scenario, rank, why):
    return (
        f"{scenario.name}, process {rank}: {why}\n--- its stderr ---\n"
        f"{scenario.stderr[rank][-3000:]}"
    )


@pytest.mark.parametrize("name", sorted(_EXPECTED))
def test_every_live_process_ends_in_bound_with_a_clear_error(scenarios, name):
    scenario = scenarios[name]
    for rank in _live_processes(name):
        proc = scenario.procs[rank]
        assert scenario.ended[rank] is not None, _failure(
            scenario, rank, f"still running after {SCENARIO_BOUND} s"
        )
        assert proc.returncode not in (0, None), _failure(
            scenario, rank, "exited 0"
        )
        for expected in _EXPECTED[name].get(rank, []):
            assert expected in scenario.stderr[rank], _failure(
                scenario, rank, f"no {expected!r} in its stderr"
            )
        assert "GLHF" not in scenario.stderr[rank].split("Transport error")[0]


@pytest.mark.parametrize(
    "name, bound", [("freeze", FROZEN_BOUND), ("die", FAILED_BOUND)]
)
def test_a_peer_that_freezes_or_dies_ends_the_others_in_bound(
    scenarios, name, bound
):
    scenario = scenarios[name]
    took = scenario.ended[0] - scenario.misbehaved_at()
    assert took < bound, _failure(scenario, 0, f"took {took:.1f} s")


def test_the_process_that_raised_shows_its_traceback_once(scenarios):
    scenario = scenarios["raise"]
    err = scenario.stderr[1]
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.count("ValueError: boom from a callback") == 1, err
    took = scenario.ended[0] - scenario.misbehaved_at()
    assert took < FAILED_BOUND, _failure(scenario, 0, f"took {took:.1f} s")
