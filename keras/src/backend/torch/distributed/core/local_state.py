"""Replicated state updated on its local tensors, skipping DTensor's per-op
dispatch (an optimizer update with reduced gradients, a loss tracker's)."""

import contextlib

import torch

from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Partial


def all_replicated(values):
    """Whether every `DTensor` (or variable value) in `values` is replicated."""
    values = [getattr(x, "value", x) for x in values]
    return all(
        p.is_replicate() for x in values for p in getattr(x, "placements", ())
    )


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
def local_reads(variables):
    """Runs the block with `variables` holding their local tensors (same
    storage) if every `DTensor` among them is replicated, yielding whether
    they do: reads skip DTensor's dispatch, assignments write through."""
    values = [(v, v._value) for v in variables if isinstance(v._value, DTensor)]
    local = all(p.is_replicate() for _, x in values for p in x.placements)
    with torch.no_grad():
        swapped = [(v, x, x.to_local()) for v, x in values] if local else []
    for variable, _, value in swapped:
        variable._value = value
    try:
        yield local
    finally:
        with torch.no_grad():
            for variable, value, plain in swapped:
                if variable._value is not plain:
                    plain.copy_(variable._value)
                variable._value = value


@contextlib.contextmanager
def local_metric_state(metric, defer=None, value=None):
    """Runs `metric`'s update on its replicated state's local values, yielding
    what it reads: `value`, or with `defer` partial-sum `value`'s local term."""
    states = [v.value for v in metric.variables]
    if runtime.current_distribution() is None or not all_replicated(states):
        yield value
    elif _sums_partial_value(metric, states, defer, value):
        with _on_local_term(metric, states, value, defer) as local:
            yield local
    else:
        with local_reads(metric.variables):
            yield value


def _sums_partial_value(metric, states, defer, value):
    """Whether `metric` is Keras' `Mean` (`total` linear in the values, `count`
    blind to them) and `value` a partial sum over its `states`' 1-D mesh."""
    # Imported here: the backend imports this module.
    from keras.src.metrics import reduction_metrics

    return (
        defer is not None
        and isinstance(value, DTensor)
        and type(metric).update_state is reduction_metrics.Mean.update_state
        and not torch.compiler.is_compiling()
        and get_keras_mask(value) is None
        and value.device_mesh.ndim == 1
        and value.placements[0].is_partial()
        and value.placements[0].reduce_op == "sum"
        and all(
            isinstance(x, DTensor) and x.device_mesh == value.device_mesh
            for x in states
        )
    )


@contextlib.contextmanager
def _on_local_term(metric, states, value, defer):
    """Runs a `Mean`'s update on partial-sum `value`'s local term, yielding it:
    `total` enters as its share of a partial sum (as DTensor partitions it) and
    leaves as one, handed to `defer`; `count` reads no value."""
    mesh = value.device_mesh
    locals_ = [x.to_local() for x in states]
    with torch.no_grad():
        entered = [
            local / mesh.size() if v is metric.total else local
            for v, local in zip(metric.variables, locals_)
        ]
        with stateless_scope(zip(metric.variables, entered)) as scope:
            yield value.to_local()
        for variable, local, start in zip(metric.variables, locals_, entered):
            new_value = scope.get_current_value(variable)
            if new_value is start:
                continue
            if variable is not metric.total:
                local.copy_(new_value)
            elif not defer(local, new_value, mesh):
                total = layouts.dtensor_from_local(
                    new_value, mesh, [Partial()], shape=local.shape
                )
                local.copy_(total.full_tensor())
