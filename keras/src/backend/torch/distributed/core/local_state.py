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
def local_reads(variables):
    """Runs the block with replicated `variables` holding their local
    tensors, which share their storage: reads skip DTensor's dispatch, and
    an assignment (in place) writes the variable."""
    swapped = []
    for variable in variables:
        value = variable._value
        if isinstance(value, DTensor) and not _is_sharded(value):
            with torch.no_grad():
                local = value.to_local()
            swapped.append((variable, value, local))
            variable._value = local
    try:
        yield
    finally:
        for variable, value, local in swapped:
            if variable._value is not local:
                with torch.no_grad():
                    local.copy_(variable._value)
            variable._value = value


def _replicated(x):
    """`x` replicated on its mesh if it is a `DTensor`, else `x`."""
    if not _is_sharded(x):
        return x
    mesh = x.device_mesh
    return x.redistribute(mesh, [Replicate()] * mesh.ndim)


@contextlib.contextmanager
def local_metric_state(metric, defer=None, value=None):
    """Runs `metric`'s update on its replicated state's local values; yields
    the value the update reads: `value`, or its local term.

    A sharded or partial input is reduced by DTensor where it meets the
    state, except a `Mean`'s partial-sum `value` given with `defer`: that is
    updated on its local term with no `DTensor` op (see `_on_local_term`).
    Without a distribution or replicated state, runs unchanged."""
    if runtime.current_distribution() is None:
        yield value
        return
    states = [v.value for v in metric.variables]
    if not all_replicated(states):
        yield value
    elif _sums_partial_value(metric, states, defer, value):
        with _on_local_term(metric, states, value, defer) as local:
            yield local
    else:
        with local_reads(metric.variables):
            yield value


def _sums_partial_value(metric, states, defer, value):
    """Whether `metric` is Keras' `Mean` (its update adds the weighted
    values to `total`, their weights or count to `count`: `total` linear in
    the values, `count` blind to them) and `value` a partial sum over the
    1-D mesh of its `states`, to be reduced by `defer`."""
    # Imported here: the backend imports this module.
    from keras.src.metrics import reduction_metrics

    if (
        defer is None
        or not isinstance(value, DTensor)
        or type(metric).update_state is not reduction_metrics.Mean.update_state
        or torch.compiler.is_compiling()
        or get_keras_mask(value) is not None
    ):
        return False
    mesh = value.device_mesh
    placement = value.placements[0]
    return (
        mesh.ndim == 1
        and placement.is_partial()
        and placement.reduce_op == "sum"
        and all(
            isinstance(x, DTensor) and x.device_mesh == mesh for x in states
        )
    )


@contextlib.contextmanager
def _on_local_term(metric, states, value, defer):
    """Runs a `Mean`'s update on partial-sum `value`'s local term with no
    `DTensor` op; yields that term.

    `total` enters as its share of a partial sum (the replicated value over
    the mesh's size, as DTensor partitions one meeting a partial sum), so
    it leaves as a partial sum handed to `defer` (reduced in the step's last
    bucket) with DTensor's numbers; `count` reads no value and is written
    back as it is, identical on every process."""
    mesh = value.device_mesh
    local_states = [x.to_local() for x in states]
    with torch.no_grad():
        entered = [
            local / mesh.size() if v is metric.total else local
            for v, local in zip(metric.variables, local_states)
        ]
        with stateless_scope(zip(metric.variables, entered)) as scope:
            yield value.to_local()
        for variable, local, start in zip(
            metric.variables, local_states, entered
        ):
            new_value = scope.get_current_value(variable)
            if new_value is start:
                continue
            if variable is metric.total:
                new_value = layouts.dtensor_from_local(
                    new_value, mesh, [Partial()], shape=local.shape
                )
            if not defer(local, new_value):
                local.copy_(local_value(_replicated(new_value)))
