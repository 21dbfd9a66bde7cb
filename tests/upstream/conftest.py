"""What upstream Keras' test files import from Keras' repository root.

Upstream's own `*_test.py` files ship in the Keras wheel, but the
`conftest.py` of Keras' repository, which they import (`skip_if_backend`)
and whose markers they use, does not. This stands in for it when
`integration_tests/test_upstream_keras_tests.py` runs them.
"""

import pytest

from keras.src.backend import backend


def pytest_configure(config):
    for marker in (
        "requires_trainable_backend: needs a backend that can train",
        "large: a slow test",
        "multi_device: needs a job of several devices",
    ):
        config.addinivalue_line("markers", marker)


def pytest_collection_modifyitems(config, items):
    trainable = backend() != "numpy"
    for item in items:
        if not trainable and "requires_trainable_backend" in item.keywords:
            item.add_marker(
                pytest.mark.skip(reason="needs a trainable backend")
            )


def skip_if_backend(given_backend, reason):
    return pytest.mark.skipif(backend() == given_backend, reason=reason)
