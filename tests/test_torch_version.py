"""A torch without DTensor gets a clear error, not a fallback."""

import pytest
import torch

import keras
from keras.src.backend.torch.distributed.core import runtime


@pytest.mark.parametrize("missing", ["old_version", "no_dtensor"])
def test_set_distribution_names_the_minimum_torch_version(monkeypatch, missing):
    distribution = keras.distribution.DataParallel()
    if missing == "old_version":
        monkeypatch.setattr(torch, "__version__", "2.4.1")
    else:
        monkeypatch.setattr(runtime, "DTENSOR_AVAILABLE", False)
    with pytest.raises(RuntimeError, match=r"torch>=2\.5") as error:
        keras.distribution.set_distribution(distribution)
    assert "Found torch==" in str(error.value)
    assert keras.distribution.distribution() is None
