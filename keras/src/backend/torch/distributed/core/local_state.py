"""Replicated state updated on its local values.

A replicated `DTensor` holds the whole value on every process, so code that
reads and writes only replicated values (the optimizer's update of
replicated weights with reduced gradients, the loss tracker's update with
the reduced loss) computes the same numbers on the local tensors, without
DTensor's dispatch of every op. Under data parallelism every variable is
replicated, and that dispatch was most of a small step's cost.
"""

import contextlib

import torch

from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate


def all_replicated(values):
    """Whether every `DTensor` (or variable's value) in `values` is
    replicated on all its mesh axes; plain tensors count as replicated."""
    for x in values:
        x = getattr(x, "value", x)
        if isinstance(x, DTensor) and not all(
            p.is_replicate() for p in x.placements
        ):
            return False
    return True


def stateless_scope(mapping, collect_losses=False):
    """A `StatelessScope` in which each variable reads the value given.

    `StatelessScope(state_mapping=...)` converts and checks each value (a
    device and dtype conversion and a shape comparison per variable, in
    every step for every weight and optimizer variable); the values here
    are the variables' own local tensors, of their device, dtype and shape
    already, and enter the scope as updates do (`add_update`).

    Args:
        mapping: pairs `(variable, its local tensor)`.
        collect_losses: whether the losses layers add in the scope are
            kept in its `losses` (else they are dropped).

    Returns:
        The scope, not entered.
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

    Updates made in place change the variables' local tensors directly;
    values assigned anew are copied into them when the block ends (nothing
    is written back if it raises), whole: a `DTensor` value still partial
    or sharded is replicated first.

    Args:
        variables: replicated variables (see `all_replicated`).
        defer: optionally, `defer(local, value)` takes a partial `DTensor`
            value assigned to the variable of local tensor `local`, to
            write it whole later, and returns whether it did (see
            `step_reduction.OverlappedReduction.defer`).

    Yields:
        Nothing.
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
    """`x` replicated on its mesh if it is a `DTensor` (a collective where
    it is partial or sharded); anything else as it is."""
    if not isinstance(x, DTensor) or all(
        p.is_replicate() for p in x.placements
    ):
        return x
    mesh = x.device_mesh
    return x.redistribute(mesh, [Replicate()] * mesh.ndim)


@contextlib.contextmanager
def local_metric_state(metric, defer=None):
    """Runs a metric's update on the local values of its replicated state.

    A `DTensor` still sharded or partial that reaches the update (the loss
    under data parallelism, each process' share of it) is computed on by
    DTensor, which reduces it where it meets the replicated state (one
    all-reduce of one number), and the result is written back whole.
    Without a distribution, or with state that is not replicated, the
    block runs as it is.

    Args:
        metric: a `keras.metrics.Metric`.
        defer: see `on_local_values`.

    Yields:
        Nothing.
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
