"""Replicated state updated on its local tensors, skipping DTensor's per-op
dispatch (an optimizer update with reduced gradients, a loss tracker's)."""

import contextlib

import torch

from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate


def _is_sharded(x):
    return isinstance(x, DTensor) and not all(
        p.is_replicate() for p in x.placements
    )


def all_replicated(values):
    """Whether every `DTensor` (or variable value) in `values` is replicated."""
    return not any(_is_sharded(getattr(x, "value", x)) for x in values)


def stateless_scope(mapping, collect_losses=False):
    """An unentered `StatelessScope` reading `mapping`'s `(variable, local
    tensor)` pairs, added as updates to skip `state_mapping=`'s checks."""
    scope = StatelessScope(collect_losses=collect_losses)
    for variable, value in mapping:
        scope.add_update((variable, value))
    return scope


def local_value(x):
    """The local tensor of a `DTensor`; anything else as it is."""
    return x.to_local() if isinstance(x, DTensor) else x


@contextlib.contextmanager
def on_local_values(variables, defer=None):
    """Runs the block with replicated `variables` as local tensors; new values
    are copied in at the end unless `defer(local, value)` takes one to write
    later (returns True)."""
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
    if not _is_sharded(x):
        return x
    mesh = x.device_mesh
    return x.redistribute(mesh, [Replicate()] * mesh.ndim)


@contextlib.contextmanager
def local_metric_state(metric, defer=None):
    """Runs `metric`'s update on its replicated state's local values.

    A sharded or partial input is reduced by DTensor where it meets the
    state. Without a distribution or replicated state, runs unchanged."""
    if runtime.current_distribution() is None or not all_replicated(
        metric.variables
    ):
        yield
        return
    with on_local_values(metric.variables, defer):
        yield
