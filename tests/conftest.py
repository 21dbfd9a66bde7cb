"""Pytest configuration shared by the project's tests.

Provides:
    * the `ranks` fixture: `tests.harness.run_on_ranks`, whose default
      timeout comes from the test's `@pytest.mark.multirank_timeout(s)`
      marker when it has one;
    * the shutdown of the multi-rank worker pools at the end of the
      session (process groups destroyed, workers joined).
"""

import os

# The project is Keras' torch backend; test modules import keras at
# module level, so this must be set before they are collected.
os.environ["KERAS_BACKEND"] = "torch"

import pytest  # noqa: E402

from tests import harness  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "multirank_timeout(seconds): default timeout of the multi-rank "
        "calls made through the `ranks` fixture (see tests/harness.py).",
    )


@pytest.fixture(scope="session", autouse=True)
def _multirank_pools():
    """Stops the worker pools, if any were started, after the session."""
    yield
    harness.shutdown_pools()


@pytest.fixture
def ranks(request):
    """Returns `run_on_ranks`, with the test's marker timeout as default.

    Usage::

        @pytest.mark.multirank_timeout(30)
        def test_x(ranks):
            assert ranks(_body, world_size=4, args=(1,)) == [...]
    """
    marker = request.node.get_closest_marker("multirank_timeout")
    marker_timeout = marker.args[0] if marker else None

    def run(fn, world_size=2, args=(), kwargs=None, timeout=None):
        if timeout is None:
            timeout = marker_timeout
        return harness.run_on_ranks(
            fn, world_size=world_size, args=args, kwargs=kwargs,
            timeout=timeout,
        )

    return run
