"""`ModelParallel` names a `batch_dim_name` that is not a mesh axis.

It raised `ValueError: 'batch' is not in list` from deep in its
constructor; the error now says which axis was given and which the mesh has.
"""

import pytest

from keras import distribution as kd


def test_batch_dim_name_not_in_the_mesh_is_named():
    mesh = kd.DeviceMesh((1, 2), ["data", "model"], devices=["cpu:0", "cpu:1"])
    with pytest.raises(ValueError, match="batch_dim_name='batch'") as error:
        kd.ModelParallel(layout_map=kd.LayoutMap(mesh), batch_dim_name="batch")
    assert "['data', 'model']" in str(error.value)


def test_batch_dim_name_of_the_mesh_is_taken():
    mesh = kd.DeviceMesh((1, 2), ["data", "model"], devices=["cpu:0", "cpu:1"])
    distribution = kd.ModelParallel(
        layout_map=kd.LayoutMap(mesh), batch_dim_name="model"
    )
    assert distribution.batch_dim_name == "model"
