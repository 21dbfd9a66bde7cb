"""`keras.random.uniform` on torch scales its draw in place: the same numbers
as `minval + (maxval - minval) * u` of the same draw `u`."""

import numpy as np
import pytest

import keras


@pytest.mark.parametrize("shape", [(64, 3), (5,), ()])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_uniform_is_the_scaled_unit_draw(shape, dtype):
    unit = keras.random.uniform(shape, 0.0, 1.0, dtype=dtype, seed=7)
    drawn = keras.random.uniform(shape, -2.0, 3.0, dtype=dtype, seed=7)
    unit = keras.ops.convert_to_numpy(unit)
    drawn = keras.ops.convert_to_numpy(drawn)
    assert drawn.shape == shape and drawn.dtype == np.dtype(dtype)
    expected = (5.0 * keras.ops.convert_to_tensor(unit) - 2.0).cpu().numpy()
    np.testing.assert_array_equal(drawn, expected.astype(dtype))
    assert np.all((drawn >= -2.0) & (drawn <= 3.0))
