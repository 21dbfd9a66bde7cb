"""Pytest configuration shared by the project's tests.

Sets the Keras backend before test modules are collected, and stops the
multi-rank worker pools of `tests/harness.py` at the end of the session
(process groups destroyed, workers joined).
"""

import os

# The project is Keras' torch backend; test modules import keras at
# module level, so this must be set before they are collected.
os.environ["KERAS_BACKEND"] = "torch"

# The multi-rank tests run CPU processes on gloo, as CI does, whatever the
# machine has: the GPUs are hidden from them (two processes cannot share a
# GPU under NCCL). `tests/test_cuda.py` gives its jobs the GPUs saved here.
VISIBLE_GPUS_ENV = "KERAS_TEST_VISIBLE_GPUS"
ALL_GPUS = "all"
os.environ.setdefault(
    VISIBLE_GPUS_ENV, os.environ.get("CUDA_VISIBLE_DEVICES", ALL_GPUS)
)
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import importlib.metadata  # noqa: E402

import pytest  # noqa: E402

from tests import harness  # noqa: E402

# Test modules that cannot run on the nightly base, and why.
NOT_ON_KERAS_MASTER = {
    # The auto-parallel tests of Keras' own models run on both bases.
    "test_keras_hub_catalogue.py": (
        "keras-hub 0.31.1 does not import with Keras master"
    ),
    "test_upstream_distribution_tests.py": (
        "the keras-nightly wheel (and sdist) ships no upstream tests to run"
    ),
}


def on_keras_master():
    """Whether the installed package was built on a Keras master nightly
    (`run_tests.sh --base nightly`): its version is not 3.15.1's."""
    return not importlib.metadata.version("keras").startswith("3.15.1+")


def pytest_collection_modifyitems(config, items):
    """Skips, on the nightly base, what cannot run there, saying why."""
    if not on_keras_master():
        return
    for item in items:
        reason = NOT_ON_KERAS_MASTER.get(item.path.name)
        if reason is not None:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"{reason} (keras-nightly): runs on 3.15.1 only"
                )
            )


@pytest.fixture(scope="session", autouse=True)
def _multirank_pools():
    """Stops the worker pools, if any were started, after the session."""
    yield
    harness.shutdown_pools()
