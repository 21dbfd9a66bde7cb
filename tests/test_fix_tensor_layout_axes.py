"""A `TensorLayout` may shard one dimension over several mesh axes, as
JAX's `PartitionSpec(("batch", "model"))` does."""

import pytest

from keras import distribution as kd


def _mesh():
    return kd.DeviceMesh(
        (2, 2), ["batch", "model"], devices=[f"cpu:{i}" for i in range(4)]
    )


def test_several_axes_for_one_dimension_are_accepted():
    layout = kd.TensorLayout((("batch", "model"), None), _mesh())
    assert layout.axes == (("batch", "model"), None)


def test_an_unknown_axis_among_several_is_refused():
    with pytest.raises(ValueError, match="Invalid axis names"):
        kd.TensorLayout((("batch", "heads"), None), _mesh())
