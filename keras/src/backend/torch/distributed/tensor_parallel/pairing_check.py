"""The auto plan's column and row pairs, checked against what layers read.

`AutoModelParallel` pairs kernels by their widths as they are created
(`keras/src/distribution/auto_plan.py`). Where a feed-forward layer is as
wide as its block (a tiny config), a kernel reading another kernel's output
has the block's width too, and widths cannot tell it from one reading the
block's stream. What a kernel reads is checked at the first symbolic call
of the layer that holds it, as a functional model is built: before its
weights are loaded (a preset's are loaded after its constructor builds it)
and before any optimizer slot copies its layout.

- A block (a layer with layers inside) is traced once: its `call` runs on
  stand-ins for its inputs and weights, on the meta device, or on zeros
  where an op lacks a meta implementation (as Keras' own shape inference
  falls back), and each tensor carries the column-parallel kernels whose
  output reached it through the ops between (`_Trace`, a
  `TorchFunctionMode`). A kernel paired by widths reads a column-parallel
  output if its input carries one.
- A kernel of a functional model itself (a `Sequential` of `Dense` layers)
  is checked on the model's graph: its input is walked back through layers
  without kernels to the kernels that produced it.

A kernel that reads otherwise than its widths said is laid out again
(`AutoModelParallel.check_pairing` says how; `_relayout` moves the value).
The check moves data only: any layout computes the same numbers, so a
block neither can run keeps the width pairing (logged), as does a kernel
the trace does not reach.
"""

import functools
import threading
import weakref

import torch
from torch.overrides import TorchFunctionMode

from keras.src import tree
from keras.src.backend.common.keras_tensor import KerasTensor
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate

# A dimension of unknown size (batch, sequence) is traced at this size:
# small, since a block the meta device cannot run is run on zeros.
UNKNOWN_DIMENSION = 8
# The roles of `keras/src/distribution/plan_pairs.py` (not imported: the
# backend is imported before `keras.src.distribution`).
COLUMN = "column"
ROW = "row"

# The trace running in this thread, if any (layer calls inside it go to
# `_Trace.call_layer`).
_state = threading.local()


def active_trace():
    """The `_Trace` running in this thread, or `None`."""
    return getattr(_state, "trace", None)


def check_layer(layer, distribution, args, kwargs):
    """Checks the pairings of `layer`'s kernels after its first symbolic
    call with `KerasTensor`s (a functional model being built).

    Args:
        layer: the layer called.
        distribution: the distribution in effect.
        args: the positional arguments of the call.
        kwargs: its keyword arguments.
    """
    if not hasattr(distribution, "check_pairing"):
        return
    if distribution.paired_role(layer) is not None:
        inputs = tree.flatten((args, kwargs))
        reads = bool(inputs) and _graph_reads_column(inputs[0], distribution)
        _check(layer, distribution, reads)
        return
    roles = (
        (inner, distribution.paired_role(inner))
        for inner in layer._flatten_layers(include_self=False)
    )
    paired = [(inner, role) for inner, role in roles if role is not None]
    if not paired:
        return
    trace = _Trace(distribution)
    try:
        trace.run(layer, args, kwargs)
    except Exception as error:  # noqa: BLE001 - a trace only informs.
        # Ops neither the meta device nor zeros can run (a check of the
        # values, say): the width pairing stands.
        runtime.log_debug(
            "pairings of %s not checked: its trace failed (%s)",
            layer.name,
            error,
        )
        trace.reads.clear()
    # A kernel the trace did not reach (a branch not taken) keeps its
    # width pairing: checked once, a model holding the layer does not
    # trace it again.
    for inner, role in paired:
        reads = trace.reads.get(inner, role == ROW)
        _check(inner, distribution, reads)


def _check(layer, distribution, reads_column_output):
    for variable, layout in distribution.check_pairing(
        layer, reads_column_output
    ):
        _relayout(variable, layout)
        runtime.log_debug(
            "variable %s laid out again: %s", variable.path, layout.axes
        )


def _relayout(variable, layout):
    """Moves `variable`'s value to `layout`, keeping its parameter object
    (the layers that track it hold that object)."""
    value = variable._value
    if not isinstance(value, DTensor):
        return
    torch_layout = layouts.as_torch_layout(layout)
    mesh = torch_layout.device_mesh
    with torch.no_grad():
        whole = value.detach().redistribute(mesh, [Replicate()] * mesh.ndim)
        moved = whole.redistribute(mesh, torch_layout.placements)
    parameter = torch.nn.Parameter(moved, requires_grad=value.requires_grad)
    torch.utils.swap_tensors(value, parameter)
    variable._layout = layout


def _graph_reads_column(x, distribution):
    """Whether the symbolic tensor `x` is computed from a column-parallel
    kernel's output, through layers and ops without kernels."""
    pending, seen = [x], set()
    while pending:
        history = getattr(pending.pop(), "_keras_history", None)
        if history is None or id(history.operation) in seen:
            continue
        operation = history.operation
        seen.add(id(operation))
        role = distribution.kernel_role(operation)
        if role == COLUMN:
            return True
        if role is not None or _is_block(operation):
            # A row-parallel or stacked kernel's output, like a block's, is
            # whole.
            continue
        node = operation._inbound_nodes[history.node_index]
        pending.extend(node.input_tensors)
    return False


def _is_block(operation):
    flatten = getattr(operation, "_flatten_layers", None)
    return flatten is not None and any(
        True for _ in flatten(include_self=False)
    )


class _Trace(TorchFunctionMode):
    """Runs a block on stand-ins, following which column-parallel kernels'
    outputs each tensor is computed from.

    Attributes:
        reads: `{layer: whether its input is computed from a column-parallel
            kernel's output}` for each layer whose kernel widths paired.
    """

    def __init__(self, distribution):
        super().__init__()
        self.distribution = distribution
        self.reads = weakref.WeakKeyDictionary()
        # id(tensor) -> (weak reference to it, the column kernels it
        # carries).
        self._carried = {}

    def run(self, layer, args, kwargs):
        """Calls `layer` on stand-ins for `args`, `kwargs` and its weights:
        on the meta device, else (as Keras' own `compute_output_spec` does
        where an op lacks a meta implementation) on zeros."""
        try:
            self._run(layer, args, kwargs, "meta")
        except Exception:  # noqa: BLE001 - retried on real tensors.
            self.reads.clear()
            self._carried.clear()
            self._run(layer, args, kwargs, None)

    def _run(self, layer, args, kwargs, device):
        from keras.src.backend.torch.core import device_scope
        from keras.src.backend.torch.core import get_device
        from keras.src.backend.torch.core import to_torch_dtype

        # Keras converts a mapped weight to the current device.
        with device_scope(device or get_device()) as device:
            args, kwargs = tree.map_structure(
                functools.partial(_stand_in, device=device), (args, kwargs)
            )
            weights = [
                (v, _zeros(v.shape, to_torch_dtype(v.dtype), device))
                for v in layer.variables
            ]
            _state.trace = self
            try:
                with (
                    StatelessScope(state_mapping=weights),
                    torch.no_grad(),
                    self,
                ):
                    layer.call(*args, **kwargs)
            finally:
                _state.trace = None

    def call_layer(self, call_function, layer, args, kwargs):
        """A layer call inside the trace: records what a paired kernel
        reads, and marks a kernel's output with what its role makes it."""
        paired = self.distribution.paired_role(layer)
        if paired is not None and layer not in self.reads:
            inputs = tree.flatten((args, kwargs))
            self.reads[layer] = bool(inputs) and bool(self._of(inputs[0]))
        outputs = call_function(layer, *args, **kwargs)
        role = self.distribution.kernel_role(layer)
        if paired is not None:
            role = ROW if self.reads[layer] else COLUMN
        if role == COLUMN:
            self._mark(outputs, frozenset((id(layer),)))
        elif role is not None:
            self._mark(outputs, frozenset())
        return outputs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        outputs = func(*args, **kwargs)
        carried = self._of((args, kwargs))
        if carried:
            # An in-place op's output is one of its inputs: it keeps what
            # it carried.
            self._mark(outputs, frozenset(carried))
        return outputs

    def _of(self, values):
        """The column kernels whose outputs `values` are computed from."""
        carried = set()
        for x in _tensors(values):
            entry = self._carried.get(id(x))
            if entry is not None and entry[0]() is x:
                carried |= entry[1]
        return carried

    def _mark(self, values, carried):
        for x in _tensors(values):
            self._carried[id(x)] = (weakref.ref(x), carried)


def _tensors(values):
    """The torch tensors in nested lists, tuples and dicts."""
    if isinstance(values, torch.Tensor):
        yield values
    elif isinstance(values, (list, tuple)):
        for x in values:
            yield from _tensors(x)
    elif isinstance(values, dict):
        for x in values.values():
            yield from _tensors(x)


def _stand_in(x, device):
    if not isinstance(x, KerasTensor):
        return x
    from keras.src.backend.torch.core import TORCH_DTYPES

    shape = tuple(UNKNOWN_DIMENSION if d is None else d for d in x.shape)
    return _zeros(shape, TORCH_DTYPES[x.dtype], device)


def _zeros(shape, dtype, device):
    # Zeros, not uninitialized memory: an integer weight may be an index.
    return torch.zeros(tuple(shape), dtype=dtype, device=device)
