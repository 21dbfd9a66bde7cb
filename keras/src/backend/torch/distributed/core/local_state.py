"""Replicated state updated on its local values.

Code that reads and writes only replicated values (an optimizer update with
reduced gradients, a loss tracker's update) computes the same on each
process' local tensors, skipping DTensor's per-op dispatch.
"""

import contextlib

import torch

from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate


def all_replicated(values):
    """Whether every `DTensor` (or variable value) in `values` is replicated."""
    for x in values:
        x = getattr(x, "value", x)
        if isinstance(x, DTensor) and not all(
            p.is_replicate() for p in x.placements
        ):
            return False
    return True


def stateless_scope(mapping, collect_losses=False):
    """A `StatelessScope`, not entered, where each variable reads its value.

    Values enter as updates, skipping `state_mapping=`'s per-variable
    conversion and checks: they are the variables' own local tensors.

    Args:
        mapping: pairs `(variable, its local tensor)`.
        collect_losses: whether losses added in the scope are kept.
    """
    scope = StatelessScope(collect_losses=collect_losses)
    for variable, value in mapping:
        scope.add_update((variable, value))
    return scope


def local_value(x):
    """The local tensor of a `DTensor`; anything else as it is."""
    return x.to_local() if isinstance(x, DTensor) else x


@contextlib.contextmanager
def on_local_values(variables, defer=None):
    """Runs the block with `variables` read and assigned as local tensors.

    Values assigned anew are replicated and copied in when the block ends.

    Args:
        variables: replicated variables (see `all_replicated`).
        defer: optional `defer(local, value)`: takes a partial `DTensor`
            assigned to `local`'s variable to write later, and returns
            whether it did (`step_reduction.OverlappedReduction.defer`).
    """
    local_values = [(v, local_value(v.value)) for v in variables]
    with stateless_scope(local_values) as scope:
        yield
    with torch.no_grad():
        for variable, local in local_values:
            new_value = scope.get_current_value(variable)
            if new_value is local:
                continue
            if defer is None or not defer(local, new_value):
                local.copy_(local_value(_replicated(new_value)))


def _replicated(x):
    """`x` replicated on its mesh if it is a `DTensor`, else `x`."""
    if not isinstance(x, DTensor) or all(
        p.is_replicate() for p in x.placements
    ):
        return x
    mesh = x.device_mesh
    return x.redistribute(mesh, [Replicate()] * mesh.ndim)


@contextlib.contextmanager
def local_metric_state(metric, defer=None):
    """Runs a metric's update on the local values of its replicated state.

    A sharded or partial input (each process' share of the loss) is reduced
    by DTensor where it meets the state. Without a distribution or with
    unreplicated state, the block runs unchanged.

    Args:
        metric: a `keras.metrics.Metric`.
        defer: see `on_local_values`.
    """
    if runtime.current_distribution() is None:
        yield
        return
    variables = list(metric.variables)
    if not all_replicated(variables):
        yield
        return
    with on_local_values(variables, defer):
        yield
