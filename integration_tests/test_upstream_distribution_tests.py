"""Upstream Keras' own generic distribution tests, run for torch.

The Keras 3.15.1 wheel ships `keras/src/distribution/distribution_lib_test.py`,
the tests of the generic `keras.distribution` API. Most of its classes are
skipped unless the backend is JAX ("Only JAX has the proper backend
distribution lib"). This is what an upstream reviewer of a torch backend
would run: the file as the wheel ships it, with those skips lifted for
torch. It is read from the installed package and written, with its skip
condition rewritten and nothing else changed, to a temporary directory.

Tests that need several devices (marked `multi_device`: they build their
mesh from `list_devices()`) run under torchrun, one gloo process per device
of their mesh, on every process. The others run in one process: their
8-device meshes describe a job that is never started, and nothing they do
needs one.
"""

import concurrent.futures
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import keras
from tests import harness

REPO = Path(__file__).resolve().parents[1]
UPSTREAM_TEST = "keras/src/distribution/distribution_lib_test.py"
JAX_ONLY = 'backend.backend() != "jax"'
JAX_OR_TORCH = 'backend.backend() not in ("jax", "torch")'
# The classes skipped unless the backend is JAX.
NUM_JAX_ONLY_SKIPS = 4
# `DataShardingIntegrationTest` builds a (processes / 2, "data") x (2,
# "model") mesh; 4 processes make two model replicas of two processes each.
MULTI_DEVICE_PROCESSES = 4
TIMEOUT = 300

# Each torchrun process runs pytest and writes its own report.
_PYTEST_ON_EACH_RANK = """
import os
import sys

import pytest

report = os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.xml")
sys.exit(pytest.main(sys.argv[2:] + [f"--junitxml={report}"]))
"""


def _write_test_file(directory):
    """Writes upstream's test file with its JAX-only skips lifted."""
    installed = Path(keras.__file__).resolve().parents[1]
    source = (installed / UPSTREAM_TEST).read_text()
    assert source.count(JAX_ONLY) == NUM_JAX_ONLY_SKIPS, "upstream changed"
    path = Path(directory) / Path(UPSTREAM_TEST).name
    path.write_text(source.replace(JAX_ONLY, JAX_OR_TORCH))
    return path


def _pytest_args(test_file, marker):
    # `tests/upstream/conftest.py` stands in for the conftest of Keras'
    # repository, which the wheel does not ship.
    return [
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "conftest",
        "-c",
        os.devnull,
        "--rootdir",
        str(test_file.parent),
        "-m",
        marker,
        str(test_file),
    ]


def _env():
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO / "tests" / "upstream")
    # The one-process run must not join a job this test runs in.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        env.pop(name, None)
    return env


def _outcomes(report):
    """`{test id: "ok" | "failed" | "skipped"}` from a junit report."""
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes[name] = "failed"
        elif case.find("skipped") is not None:
            outcomes[name] = "skipped"
        else:
            outcomes[name] = "ok"
    return outcomes


def _run_in_one_process(test_file, report):
    args = _pytest_args(test_file, "not multi_device")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *args, f"--junitxml={report}"],
        env=_env(),
        cwd=test_file.parent,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert report.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    return _outcomes(report), result.stdout


def _run_under_torchrun(test_file, reports):
    reports.mkdir()
    script = test_file.parent / "pytest_on_each_rank.py"
    script.write_text(textwrap.dedent(_PYTEST_ON_EACH_RANK))
    env = _env()
    harness.run_torchrun(
        script,
        nproc=MULTI_DEVICE_PROCESSES,
        args=[reports, *_pytest_args(test_file, "multi_device")],
        timeout=TIMEOUT,
        env={"PYTHONPATH": env["PYTHONPATH"]},
        check=False,
    )
    return [
        _outcomes(reports / f"rank{rank}.xml")
        for rank in range(MULTI_DEVICE_PROCESSES)
    ]


def test_upstream_distribution_lib_tests_pass_for_torch(tmp_path):
    test_file = _write_test_file(tmp_path)
    # The one-process run goes on while torchrun starts and runs.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        single = pool.submit(
            _run_in_one_process, test_file, tmp_path / "single.xml"
        )
        per_rank = _run_under_torchrun(test_file, tmp_path / "ranks")
        single, log = single.result()
    # The file's tests, whichever way they ran.
    assert len(single) > 30, log[-3000:]
    assert "DistributionTest::test_scope" in " ".join(single)
    multi = per_rank[0]
    assert list(multi) == [
        "distribution_lib_test.DataShardingIntegrationTest::"
        "test_distribute_dataset_sharding_behavior"
    ]
    assert not set(single) & set(multi)
    failed = {t: o for t, o in single.items() if o != "ok"}
    assert not failed, f"not passing in one process: {failed}\n{log[-3000:]}"
    for rank, outcomes in enumerate(per_rank):
        assert outcomes == {name: "ok" for name in multi}, (rank, outcomes)
