"""The plan of `AutoModelParallel` for a model, in one process, no mesh.

`record_plan(build, mesh_shape)` runs `build()` (which creates a model)
while a stand-in distribution asks the planner for each variable as it is
created and records its answer; the variables stay plain. Used by
`tests/test_auto_plan.py` and `benchmarks/bench_auto_plan_share.py`.
"""

import math

import pytest

from keras.src.backend.torch.distributed.core import variables
from keras.src.distribution import auto_plan


class PlanRecorder:
    """Stands in for the distribution: plans, records, lays out nothing.

    Attributes:
        axes: `{variable path: mesh axes per dimension}`.
        reasons: `{variable path: what in the plan decided}`.
        gathered: the paths of the variables gathered for each call.
    """

    def __init__(self, mesh_shape, batch_dim_name="batch"):
        self.mesh_shape = dict(mesh_shape)
        self.plan = auto_plan.Plan(self.mesh_shape, "model", batch_dim_name)
        self.axes = {}
        self.reasons = {}
        self.gathered = set()

    def get_variable_layout(self, variable):
        axes, reason = self.plan.layout_axes(variable)
        self.axes[variable.path] = axes
        self.reasons[variable.path] = reason
        if self.plan.gathered_for_call(variable):
            self.gathered.add(variable.path)
        return None

    def share(self, weights):
        """The fraction of `weights`' elements one process would store."""
        local = total = 0
        for variable in weights:
            size = math.prod(variable.shape)
            parts = math.prod(
                self.mesh_shape[axis]
                for axis in self.axes.get(variable.path, ())
                if axis is not None
            )
            local += size / parts
            total += size
        return local / total


class _Runtime:
    """`variables.runtime` with the recorder for the distribution, which
    only variable creation sees (layer calls run as with none)."""

    def __init__(self, recorder):
        self.current_distribution = lambda: recorder


def record_plan(build, mesh_shape=None, batch_dim_name="batch"):
    """Runs `build()`; returns the `PlanRecorder` of its variables.

    Args:
        build: creates a model (its return value is ignored).
        mesh_shape: `{"batch": B, "model": M}`; default a (1, 2) mesh.
        batch_dim_name: the batch's mesh axis (`"model"` on a 1-D mesh).
    """
    recorder = PlanRecorder(
        mesh_shape or {"batch": 1, "model": 2}, batch_dim_name
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(variables, "runtime", _Runtime(recorder))
        build()
    return recorder
