"""A collective call made on some processes only stops them, clearly.

Each scenario of `tests/one_sided_call_scenario.py` runs under torchrun on
2 processes, the one that stops every process also on 4; the scenarios of
one world size run at once. Without
the call agreement, process 0's read pairs with another collective (it
returns another collective's data, or the job aborts), or waits until the
transport gives up.
"""

import concurrent.futures
import functools
import glob
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from tests import harness

SCRIPT = os.path.join(os.path.dirname(__file__), "one_sided_call_scenario.py")
# Collectives and calls wait this long: a scenario that is not stopped by
# the agreement would take at least this long to fail.
TIMEOUT = 60
# How soon a mismatch must stop the processes, on a loaded 2-core machine.
PROMPT = 20
KERNEL = "variable 'sequential/dense/kernel'"
ADVICE = "Every process of the job must make this call, in the same order"


def _run(scenario, nproc, timeout=TIMEOUT):
    env = {
        "KERAS_DISTRIBUTION_TIMEOUT": str(timeout),
        "KERAS_DISTRIBUTION_START_TIMEOUT": str(timeout),
    }
    out_dir = tempfile.mkdtemp(prefix=f"{scenario}-{nproc}-")
    result = harness.run_torchrun(
        SCRIPT, nproc, [scenario, out_dir], timeout=240, env=env, check=False
    )
    result.out_dir = out_dir
    said = "".join(
        pathlib.Path(path).read_text()
        for path in sorted(glob.glob(f"{out_dir}/outcome.rank*.txt"))
    )
    ready = re.findall(r"^READY \d+ ([\d.]+)", said, re.M)
    # From the last process ready to run its scenario to the job's end.
    result.seconds = time.time() - max(map(float, ready), default=0.0)
    raised = {}
    for line in said.splitlines():
        found = re.match(r"RAISED (\d+) (\w+) after ([\d.]+) s: (.*)", line)
        if found:
            rank, kind, seconds, message = found.groups()
            raised[int(rank)] = (kind, float(seconds), message)
    done = {int(r) for r in re.findall(r"^DONE (\d+)", said, re.M)}
    return result, raised, done


# The scenarios run on each number of processes (all at once).
SCENARIOS = {
    2: {
        "read_then_exit": {},
        "read_then_fit": {},
        "callback_read": {},
        "read_while_busy": {"timeout": 5},
        "read_everywhere": {},
    },
    # Every process stopping, with more than one that did not read: a
    # callback's read and the reads everywhere are the same calls as on 2.
    4: {"read_then_fit": {}},
}


@functools.cache
def _runs(nproc):
    scenarios = SCENARIOS[nproc]
    with concurrent.futures.ThreadPoolExecutor(len(scenarios)) as pool:
        futures = {
            name: pool.submit(_run, name, nproc, **kwargs)
            for name, kwargs in scenarios.items()
        }
        return nproc, {name: f.result() for name, f in futures.items()}


@pytest.fixture(params=[2, 4])
def runs(request):
    """The scenarios' results on `request.param` processes."""
    return _runs(request.param)


def _failure(result):
    return harness._output_tails(result)


def test_a_read_on_one_process_then_its_end():
    nproc, results = _runs(2)
    result, raised, done = results["read_then_exit"]
    assert result.returncode != 0, _failure(result)
    assert done == set(range(1, nproc)), _failure(result)
    kind, seconds, message = raised[0]
    assert kind == "CallMismatchError", message
    assert seconds < PROMPT, message
    assert "Process 0 made a collective call that process" in message
    assert KERNEL in message and ADVICE in message, message
    assert "process 1: the end of its program" in message, message
    assert "variable.value.to_local()" in message, message


def test_a_read_on_one_process_then_fit_everywhere(runs):
    nproc, results = runs
    result, raised, done = results["read_then_fit"]
    assert result.returncode != 0 and not done, _failure(result)
    # Every process stops, none with another collective's data.
    assert set(raised) == set(range(nproc)), _failure(result)
    kind, seconds, message = raised[0]
    assert kind == "CallMismatchError" and seconds < PROMPT, message
    assert KERNEL in message, message
    # The processes that announced `fit` first are named.
    assert re.search(r"process \d: the start of `fit`", message), message
    for rank in range(1, nproc):
        kind, seconds, message = raised[rank]
        assert kind == "CallMismatchError" and seconds < PROMPT, message
        assert "the start of `fit`" in message, message
        read = f"process 0: a read of the global value of {KERNEL}"
        assert read in message, message


def test_a_read_in_a_callback_on_one_process_during_fit():
    nproc, results = _runs(2)
    result, raised, done = results["callback_read"]
    assert result.returncode != 0 and not done, _failure(result)
    assert 0 in raised, _failure(result)
    kind, seconds, message = raised[0]
    assert kind == "CallMismatchError" and seconds < PROMPT, message
    assert KERNEL in message, message
    # The others were already in the next step: it rules the read out.
    assert re.search(r"process \d: runs train step 4", message), message
    # The others stop with the reader's error, unless torchrun stopped
    # them first, once process 0 had failed; the job ends long before the
    # collectives' timeout either way.
    assert result.seconds < TIMEOUT, _failure(result)
    for rank in set(raised) - {0}:
        kind, seconds, message = raised[rank]
        assert kind == "JobFailedError" and seconds < PROMPT, message
        assert KERNEL in message, message


def test_a_read_while_the_others_compute_waits_for_the_timeout():
    _, results = _runs(2)
    result, raised, done = results["read_while_busy"]
    # torchrun stops process 1 once process 0 has failed.
    assert result.returncode != 0 and 0 in raised, _failure(result)
    kind, seconds, message = raised[0]
    assert kind == "JobFailedError", message
    assert 5 <= seconds < 5 + PROMPT, message
    assert "waited more than 5 s for process 1" in message, message
    assert KERNEL in message and "Process 0 made it" in message, message
    assert "KERAS_DISTRIBUTION_TIMEOUT" in message, message


def test_reads_on_every_process_return_the_global_values():
    nproc, results = _runs(2)
    result, raised, done = results["read_everywhere"]
    assert result.returncode == 0 and not raised, _failure(result)
    assert done == set(range(nproc)), _failure(result)
    found = [
        json.loads(pathlib.Path(path).read_text())
        for path in sorted(glob.glob(f"{result.out_dir}/result.rank*.json"))
    ]
    assert sorted(r["rank"] for r in found) == list(range(nproc))
    reference = _one_process_result()
    for got in found:
        # The kernel is split: each process holds 8 / nproc columns.
        assert got["kernel_shape"] == [8, 8]
        for key in ("before", "in_callback", "after", "loss", "prediction"):
            for a, b in zip(_leaves(got[key]), _leaves(reference[key])):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        assert got["metrics"].keys() == reference["metrics"].keys()
        for name, value in reference["metrics"].items():
            np.testing.assert_allclose(got["metrics"][name], value, rtol=1e-4)


@functools.cache
def _one_process_result():
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", KERAS_BACKEND="torch")
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    out_dir = tempfile.mkdtemp(prefix="read_everywhere-1-")
    subprocess.run(
        [sys.executable, SCRIPT, "read_everywhere", out_dir],
        capture_output=True,
        env=env,
        timeout=240,
        check=True,
    )
    return json.loads(pathlib.Path(out_dir, "result.rank0.json").read_text())


def _leaves(value):
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [np.asarray(v) for v in value]
    return [np.asarray(value)]
