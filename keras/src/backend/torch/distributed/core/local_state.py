"""Replicated state updated on its local tensors, skipping DTensor's per-op
dispatch (an optimizer update with reduced gradients, a loss tracker's)."""

import contextlib
import weakref

import torch

from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Partial

_REPLICATED_LOCALS = {}  # `{id(replicated DTensor): (weakref, local tensor)}`


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


def replicated_local(x):
    """The local tensor of replicated `DTensor` `x` (kept: a `DTensor`'s local
    tensor and placements never change), or `None` if `x` is not."""
    return replicated_locals([x])[0]


def replicated_locals(values):
    """`replicated_local` of each of `values`."""
    compiling = torch.compiler.is_compiling()  # Dynamo would guard the cache.
    return [_replicated_local(x, compiling) for x in values]


def _replicated_local(x, compiling):
    kept = None if compiling else _REPLICATED_LOCALS.get(id(x))
    if kept is not None and kept[0]() is x:
        return kept[1]
    if not all(p.is_replicate() for p in x.placements):
        return None
    with torch.no_grad():
        local = x.to_local()
    if not compiling:
        key = id(x)  # Tensors compare by value: not weak dictionary keys.
        weakref.finalize(x, _REPLICATED_LOCALS.pop, key, None)
        _REPLICATED_LOCALS[key] = (weakref.ref(x), local)
    return local


@contextlib.contextmanager
def local_reads(variables):
    """Runs the block with `variables` on local tensors (same storage) if all
    are replicated, yielding whether: reads skip DTensor, writes go through."""
    values = [(v, v._value) for v in variables if isinstance(v._value, DTensor)]
    locals_ = replicated_locals([x for _, x in values])
    swapped = [(v, x, local) for (v, x), local in zip(values, locals_)]
    local = all(plain is not None for _, _, plain in swapped)
    swapped = swapped if local else []
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
def local_metric_state(metric, defer=None, value=None, term_mesh=None):
    """Runs `metric`'s update on its replicated state's local values, yielding
    what it reads: `value`, or with `defer` a partial sum's local term (with
    `term_mesh`, `value` is this process' plain term of a sum over it)."""
    states, mesh, term = [v.value for v in metric.variables], term_mesh, value
    if isinstance(value, DTensor) and value.device_mesh.ndim == 1:
        if value.placements[0] == Partial():
            mesh, term = value.device_mesh, value.to_local()
    if mesh is not None and _sums_terms(metric, states, defer, term, mesh):
        with _on_local_term(metric, states, term, mesh, defer) as local:
            yield local
        return
    if term_mesh is not None:
        value = layouts.dtensor_from_local(value, term_mesh, [Partial()])
    if runtime.current_distribution() is None or not all_replicated(states):
        yield value
    else:
        with local_reads(metric.variables):
            yield value


def _sums_terms(metric, states, defer, value, mesh):
    """Whether `metric` is Keras' `Mean` (`total` linear in the values, `count`
    blind to them), `states` replicated on `mesh`, `value` a term over it."""
    # Imported here: the backend imports this module.
    from keras.src.metrics import reduction_metrics

    return (
        defer is not None
        and runtime.current_distribution() is not None
        and type(metric).update_state is reduction_metrics.Mean.update_state
        and not torch.compiler.is_compiling()
        and get_keras_mask(value) is None
        and all(
            isinstance(x, DTensor) and x.device_mesh == mesh for x in states
        )
        and all_replicated(states)
    )


@contextlib.contextmanager
def _on_local_term(metric, states, local_term, mesh, defer):
    """Runs a `Mean`'s update on `local_term` of a partial sum over `mesh`,
    yielding it: `total` enters as its share of a partial sum (as DTensor
    partitions it) and leaves as one, handed to `defer`; `count` reads none."""
    locals_ = replicated_locals(states)
    with torch.no_grad():
        entered = [
            local / mesh.size() if v is metric.total else local
            for v, local in zip(metric.variables, locals_)
        ]
        with stateless_scope(zip(metric.variables, entered)) as scope:
            yield local_term
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
