"""The probe of whether a model call couples a batch's samples: a `Partial`
result through DTensor is a sum over the batch (`PartialWatch`); outputs on
the local rows may differ from DTensor's rows (`first_differing_layer`)."""

import contextlib
import threading
import typing

import torch
from torch.overrides import TorchFunctionMode

from keras.src import tree
from keras.src.backend.common import global_state
from keras.src.backend.torch.distributed.core import collectives
from keras.src.backend.torch.distributed.core.runtime import DTensor

_thread = threading.local()  # `explained`'s depth, `recording`'s calls.


class Verdict(typing.NamedTuple):
    """The probe's finding: `per_sample`, the `reason` (why not, or why
    layers couple), the `DrawPlan` (`draws`) and `coupled` layers."""

    per_sample: bool
    reason: str = ""
    draws: object = None
    coupled: tuple = ()

    def __str__(self):
        if not self.per_sample:
            return f"through DTensor: {self.reason}"
        if not self.coupled:
            return "on the local rows"
        names = ", ".join(layer.name for layer in self.coupled)
        return f"on the local rows, {names} through DTensor: {self.reason}"


@contextlib.contextmanager
def explained():
    """Marks what the block computes as coupling on purpose (not evidence)."""
    _thread.depth = getattr(_thread, "depth", 0) + 1
    try:
        yield
    finally:
        _thread.depth -= 1


class PartialWatch(TorchFunctionMode):
    """Notes torch functions returning a `Partial`; entered above the
    fallback's modes, it sees results as callers do."""

    def __init__(self):
        super().__init__()
        self.reductions = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        values = result if isinstance(result, (tuple, list)) else (result,)
        if not getattr(_thread, "depth", 0) and any(
            isinstance(x, DTensor) and any(p.is_partial() for p in x.placements)
            for x in values
        ):
            from keras.src.layers import Layer

            # The innermost layer being called (a name scope's caller).
            stack = global_state.get_global_attribute("name_scope_stack") or ()
            layers = [s.caller for s in stack if isinstance(s.caller, Layer)]
            name = getattr(func, "__name__", str(func))
            self.reductions.append((name, layers[-1] if layers else None))
        return result


def coupling_layers(model, watch):
    """`(layers, reason)` of the layers coupling samples in the probe's call;
    `None` if the model itself does."""
    summing = {}  # {layer: reason}
    for name, layer in watch.reductions:
        if layer is None or layer is model:
            return None
        summing.setdefault(layer, f"sums over the batch ({name})")
    flat = model._flatten_layers(include_self=True, recursive=True)
    losing = [layer for layer in flat if layer._get_own_losses()]
    if model in losing:
        return None
    reasons = list(summing.values()) + (["adds a loss"] if losing else [])
    layers = tuple(dict.fromkeys([*summing, *losing]))
    return layers, ", ".join(dict.fromkeys(reasons))


def model_reason(watch, coupled):
    """Why the probe's call goes through DTensor: the model couples samples
    itself (`coupling_layers` gave `None`), or an output is not rows."""
    if coupled is not None:
        return "an output is not a batch of rows"
    if watch.reductions:
        return f"sums over the batch ({watch.reductions[0][0]})"
    return "adds a loss (taken over the global batch)"


@contextlib.contextmanager
def recording():
    """Yields the `(layer, output leaves)` list of the block's layer calls."""
    previous = getattr(_thread, "calls", None)
    _thread.calls = calls = []
    try:
        yield calls
    finally:
        _thread.calls = previous


def record(layer, outputs):
    """`outputs` of a call of `layer`, recorded if `recording`."""
    calls = getattr(_thread, "calls", None)
    if calls is not None and not torch.compiler.is_compiling():
        leaves = [x for x in tree.flatten(outputs) if x is not None]
        calls.append((layer, leaves))
    return outputs


def first_differing_layer(model, dtensor_calls, local_calls, own_rows, skip):
    """The index in `model._flatten_layers(include_self=False)` of the first
    layer whose local outputs differ from DTensor's rows; -1: none or `skip`."""
    layers = list(model._flatten_layers(include_self=False))
    for i, (layer, local) in enumerate(local_calls):
        count = sum(called is layer for called, _ in local_calls[:i])
        outputs = [o for called, o in dtensor_calls if called is layer]
        if (  # A layer called inside a DTensor-routed one returns DTensors.
            layer not in layers
            or len(outputs) <= count
            or any(isinstance(x, DTensor) for x in local)
        ):
            continue
        rows = [own_rows(x) for x in outputs[count]]
        if len(rows) != len(local) or any(r is None for r in rows):
            continue
        if not all(map(same, rows, local)):
            return -1 if layer in skip else layers.index(layer)
    return -1


def agreed(reason, mesh, differing=-1):
    """`(reason or None, position of the layer to try next or -1)` agreed on
    `mesh`: a call may match on some processes only (one reading row 0)."""
    if mesh.size() == 1:
        return reason, differing
    code = 0 if reason is None else 1 if differing >= 0 else 2
    answers = collectives.all_gather_ints([code, differing], mesh.get_group())
    worst = max(code for code, _ in answers)
    if worst and reason is None:
        reason = "its outputs on another process' rows differ from DTensor's"
    positions = [position for code, position in answers if code == 1]
    return reason, min(positions) if worst == 1 else -1


def same(a, b):
    """Whether two tensors agree to float32 rounding (same kernels, rows)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach(), b.detach()
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
