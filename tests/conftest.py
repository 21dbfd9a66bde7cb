"""Pytest configuration shared by the project's tests.

Sets the Keras backend before test modules are collected, and stops the
multi-rank worker pools of `tests/harness.py` at the end of the session
(process groups destroyed, workers joined).
"""

import os

# The project is Keras' torch backend; test modules import keras at
# module level, so this must be set before they are collected.
os.environ["KERAS_BACKEND"] = "torch"

import pytest  # noqa: E402

from tests import harness  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _multirank_pools():
    """Stops the worker pools, if any were started, after the session."""
    yield
    harness.shutdown_pools()
