"""Whether a model call couples a batch's samples, found by a probe.

The probe calls through DTensor, where a `Partial` result is a sum over the
batch (`PartialWatch`), then on the local rows, where coupling makes outputs
differ from this process' rows of the first; then the first differing layer
goes through DTensor."""

import contextlib
import dataclasses
import threading

import torch
from torch.overrides import TorchFunctionMode

from keras.src import tree
from keras.src.backend.torch.distributed.core import collectives
from keras.src.backend.torch.distributed.core import generator_states
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.data_parallel import coupled_layers

# Outputs equal to float32 rounding: the same kernels on the same rows.
RTOL = 1e-5
ATOL = 1e-6

DIFFERS = "its outputs on the local rows differ from DTensor's"
OTHER_PROCESS_DIFFERS = (
    "its outputs on another process' rows differ from DTensor's"
)

_explained = threading.local()
_recorded = threading.local()


@dataclasses.dataclass(frozen=True)
class Verdict:
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
    _explained.depth = getattr(_explained, "depth", 0) + 1
    try:
        yield
    finally:
        _explained.depth -= 1


class PartialWatch(TorchFunctionMode):
    """Notes torch functions returning a `Partial`; entered above the
    fallback's modes, it sees results as callers do."""

    def __init__(self):
        super().__init__()
        self.reductions = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if not getattr(_explained, "depth", 0) and _has_partial(result):
            name = getattr(func, "__name__", str(func))
            self.reductions.append((name, coupled_layers.innermost_layer()))
        return result


def _has_partial(result):
    values = result if isinstance(result, (tuple, list)) else (result,)
    return any(
        isinstance(x, DTensor) and any(p.is_partial() for p in x.placements)
        for x in values
    )


def coupling_layers(model, watch):
    """`(layers, reason)` of the layers coupling samples in the probe's call;
    `None` if the model itself does."""
    layers, reasons = [], []
    for name, layer in watch.reductions:
        if layer is None or layer is model:
            return None
        if layer not in layers:
            layers.append(layer)
            reasons.append(f"sums over the batch ({name})")
    for layer in coupled_layers.loss_adding_layers(model):
        if layer is model:
            return None
        if layer not in layers:
            layers.append(layer)
        reasons.append("adds a loss")
    return tuple(layers), ", ".join(dict.fromkeys(reasons))


def verdict_of(watch, outputs, local_outputs, reason=None, coupled=None):
    """The probe's `Verdict` from `watch`, this process' rows of the DTensor
    outputs (`None`: one is not rows), the local outputs, a `reason` ruling
    them out and `coupling_layers`'s answer."""
    if coupled is None and watch.reductions:
        name = watch.reductions[0][0]
        return Verdict(False, f"sums over the batch ({name})")
    if coupled is None:
        return Verdict(False, "adds a loss (taken over the global batch)")
    if outputs is None:
        return Verdict(False, "an output is not a batch of rows")
    if reason is not None:
        return Verdict(False, reason)
    if local_outputs is None or len(local_outputs) != len(outputs):
        return Verdict(False, "its outputs on the local rows differ in shape")
    if not all(map(same, outputs, local_outputs)):
        return Verdict(False, DIFFERS)
    layers, why = coupled
    return Verdict(True, why, coupled=layers)


@contextlib.contextmanager
def recording():
    """Yields the `(layer, output leaves)` list of the block's layer calls."""
    previous = getattr(_recorded, "calls", None)
    _recorded.calls = calls = []
    try:
        yield calls
    finally:
        _recorded.calls = previous


def record(layer, outputs):
    """`outputs` of a call of `layer`, recorded if `recording`."""
    if torch.compiler.is_compiling():
        return outputs
    calls = getattr(_recorded, "calls", None)
    if calls is not None:
        calls.append(
            (layer, [x for x in tree.flatten(outputs) if x is not None])
        )
    return outputs


def first_differing_layer(model, dtensor_calls, local_calls, own_rows, skip):
    """The index in `model._flatten_layers(include_self=False)` of the first
    layer whose `local_calls` outputs differ from the `own_rows` of its
    `dtensor_calls` ones, or -1 (none, or in `skip`)."""
    layers = list(model._flatten_layers(include_self=False))
    seen = {}
    for layer, local in local_calls:
        count = seen[id(layer)] = seen.get(id(layer), -1) + 1
        outputs = [o for called, o in dtensor_calls if called is layer]
        # A layer called inside one called through DTensor returns DTensors.
        if (
            layer not in layers
            or len(outputs) <= count
            or any(isinstance(x, DTensor) for x in local)
        ):
            continue
        rows = [own_rows(x) for x in outputs[count]]
        if len(rows) != len(local) or any(r is None for r in rows):
            continue
        if not all(same(r, x) for r, x in zip(rows, local)):
            return -1 if layer in skip else layers.index(layer)
    return -1


def agreed(verdict, mesh, differing=-1):
    """`(verdict, position of the layer to try next or -1)`, the same on all
    of `mesh`: a call may match on some processes only (one reading the
    batch's first row)."""
    if mesh.size() == 1:
        return verdict, differing
    code = 0 if verdict.per_sample else 1 if differing >= 0 else 2
    answers = collectives.all_gather_ints([code, differing], mesh.get_group())
    worst = max(code for code, _ in answers)
    if worst and verdict.per_sample:
        verdict = Verdict(False, OTHER_PROCESS_DIFFERS)
    if worst != 1:
        return verdict, -1
    return verdict, min(position for code, position in answers if code == 1)


def assigned_outside(scope, entered):
    """Whether a call in `scope` assigned a variable it was not given (its
    update would be lost)."""
    return any(key not in entered for key in scope.state_mapping)


def unseen_by_probe(plan, rng_states, scope, entered, updated, routing):
    """What a local-rows call did that its probe did not find, or `""`."""
    if plan.broken:
        return "a random draw of another shape than the probe's"
    if generator_states.advanced(rng_states, plan.unseeded, plan.python_draws):
        return "a draw from a global generator"
    if assigned_outside(scope, entered):
        return "an assignment of a variable outside the model"
    if any(v.trainable for v, _ in updated):
        return "an assignment of a trainable variable"
    if not routing.added_only(scope.losses):
        return "a loss added outside a layer that couples samples"
    return ""


def agreed_unseen(unseen, mesh):
    """`unseen`, or why another process of `mesh` leaves the local rows."""
    if mesh.size() == 1:
        return unseen
    if not collectives.any_process(unseen, mesh.get_group()) or unseen:
        return unseen
    return "another process' call did what the probe did not find"


def same(a, b):
    """Whether two tensors agree to float32 rounding."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach(), b.detach()
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)
