"""The rows of a batch, whatever its structure: `data_parts` helpers.

In one process: the rows a process takes from a global batch (the
arrays of a structure; `None` and scalars kept), the batch size of a structure,
and the error for inputs of different batch sizes. The sources read in
parts on real ranks: `tests/test_data_sources.py`.
"""

import numpy as np
import pytest

from keras.src.backend.torch.distributed.inputs import data_parts


def _batch():
    return {
        "x": np.arange(12).reshape(6, 2),
        "y": np.arange(6),
        "weight": None,
        "scale": np.float32(2.0),
    }


def test_take_rows_keeps_none_and_scalars():
    rows = data_parts.take_rows(_batch(), 2, 4)
    np.testing.assert_array_equal(rows["x"], [[4, 5], [6, 7]])
    np.testing.assert_array_equal(rows["y"], [2, 3])
    assert rows["weight"] is None
    assert rows["scale"] == np.float32(2.0)


def test_batch_size_is_the_first_array_with_a_batch_dimension():
    assert data_parts.batch_size(_batch()) == 6
    assert data_parts.batch_size((None, np.float32(1.0), np.ones((3, 1)))) == 3
    with pytest.raises(ValueError, match="no array with a batch dimension"):
        data_parts.batch_size((None, np.float32(1.0)))


def test_rows_of_different_sizes_are_refused():
    data_parts.check_rows((np.ones((2, 3)), np.ones(2), None), 2)
    with pytest.raises(ValueError, match="Received sizes 2 and 3"):
        data_parts.check_rows((np.ones((2, 3)), np.ones(3)), 2)
