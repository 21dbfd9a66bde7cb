"""What upstream Keras' test files import from Keras' repository root.

Upstream's own `*_test.py` files ship in the Keras wheel, but the
`conftest.py` of Keras' repository, which they import (`skip_if_backend`)
and whose markers they use, does not. This stands in for it when
`integration_tests/test_upstream_keras_tests.py` runs them.

It also seeds every test from its node id: some upstream tests draw
unseeded inputs (`conv_test`'s `test_conv3d` fails about one draw in a
thousand on pristine Keras), and the comparison with pristine Keras must
give both the same inputs.
"""

import random
import zlib

import numpy as np
import pytest
import torch

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


@pytest.fixture(autouse=True)
def _seed_from_node_id(request):
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def skip_if_backend(given_backend, reason):
    return pytest.mark.skipif(backend() == given_backend, reason=reason)
