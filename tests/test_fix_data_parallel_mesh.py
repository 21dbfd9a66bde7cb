"""`DataParallel` given a mesh of several axes warns, as documented.

Its warning passed the mesh's rank as `warnings.warn`'s category, which
raised `TypeError` instead.
"""

import pytest

from keras import distribution as kd


def test_data_parallel_on_a_2d_mesh_warns_and_uses_the_first_axis():
    mesh = kd.DeviceMesh((2, 1), ["batch", "model"], devices=["cpu:0", "cpu:1"])
    with pytest.warns(UserWarning, match="mesh.devices.ndim=2"):
        distribution = kd.DataParallel(device_mesh=mesh)
    assert distribution.batch_dim_name == "batch"
