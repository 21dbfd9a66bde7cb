"""Pytest configuration shared by the project's tests.

Sets the Keras backend before test modules are collected, and stops the
multi-rank worker pools of `tests/harness.py` at the end of the session
(process groups destroyed, workers joined).
"""

import os

# The project is Keras' torch backend; test modules import keras at
# module level, so this must be set before they are collected.
os.environ["KERAS_BACKEND"] = "torch"

import importlib.metadata  # noqa: E402

import pytest  # noqa: E402

from tests import harness  # noqa: E402

# Test modules of keras-hub models (the auto-parallel tests of Keras' own
# models run on both bases).
KERAS_HUB_MODULES = ("test_keras_hub.py", "test_keras_hub_catalogue.py")


def on_keras_master():
    """Whether the installed package was built on a Keras master nightly
    (`run_tests.sh --base nightly`): its version is not 3.15.1's."""
    return not importlib.metadata.version("keras").startswith("3.15.1+")


def pytest_collection_modifyitems(config, items):
    """Skips the keras-hub tests on the nightly base, saying why."""
    if not on_keras_master():
        return
    skip = pytest.mark.skip(
        reason="keras-hub 0.31.1 does not import with Keras master "
        "(keras-nightly): its tests run on the 3.15.1 base only"
    )
    for item in items:
        if item.path.name in KERAS_HUB_MODULES:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _multirank_pools():
    """Stops the worker pools, if any were started, after the session."""
    yield
    harness.shutdown_pools()
