"""The auto plan's column and row pairs, checked against what layers read.

Width pairing cannot tell a kernel reading another's output from one reading
the block's stream when both are as wide. So at a layer's first symbolic call
a block is traced on stand-ins (`_Trace`), or a functional model's graph walked
back, and a kernel that reads otherwise is laid out again. Untraceable ones
keep their width pairing, which costs collectives, never correctness.
"""

import contextlib
import threading
import weakref

import torch
from torch.overrides import TorchFunctionMode

from keras.src import tree
from keras.src.backend.common.keras_tensor import KerasTensor
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.torch.distributed.core import collectives
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate
from keras.src.backend.torch.distributed.dtensor_gaps import fallback

# Small: a block the meta device cannot run is run on zeros.
UNKNOWN_DIMENSION = 8
# `plan_pairs`' roles, not imported: the backend loads before `distribution`.
COLUMN = "column"
ROW = "row"

_state = threading.local()


def active_trace():
    """The `_Trace` running in this thread, or `None`."""
    return getattr(_state, "trace", None)


def check_layer(layer, distribution, args, kwargs):
    """Checks the pairings of `layer`'s kernels at its first symbolic call."""
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
    failure = None
    try:
        trace.run(layer, args, kwargs)
    except _CallFailed as error:
        # Ops neither meta nor zeros can run (a check of values).
        failure = str(error)
    # Every process lays out alike (relaying out is a collective), also
    # where the block's code fails on some processes only.
    if runtime.world_size() > 1 and collectives.any_process(failure, None):
        failure = failure or "it failed on another process"
    if failure is not None:
        runtime.log_debug(
            "pairings of %s not checked: its trace failed (%s)",
            layer.name,
            failure,
        )
        trace.reads.clear()
    # Unreached kernels keep their width pairing; a model holding the layer
    # does not trace it again.
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
    """Moves `variable`'s value to `layout`, keeping its parameter object."""
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
    """Whether symbolic `x` comes from a column kernel, past no other kernel."""
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
            # Row-parallel, stacked and block outputs are whole.
            continue
        node = operation._inbound_nodes[history.node_index]
        pending.extend(node.input_tensors)
    return False


def _is_block(operation):
    flatten = getattr(operation, "_flatten_layers", None)
    return flatten is not None and any(
        True for _ in flatten(include_self=False)
    )


class _CallFailed(Exception):
    """A block's call failed on stand-ins (it reads their values)."""


class _Trace(TorchFunctionMode):
    """Runs a block on stand-ins, tracking the column kernels each tensor
    reads; `reads`: whether each width-paired layer reads a column output."""

    def __init__(self, distribution):
        super().__init__()
        self.distribution = distribution
        self.reads = weakref.WeakKeyDictionary()
        self._carried = {}

    def run(self, layer, args, kwargs):
        """Calls `layer` on meta stand-ins, else on zeros; `_CallFailed` if
        both fail."""
        try:
            self._run(layer, args, kwargs, "meta")
        except _CallFailed:
            self.reads.clear()
            self._carried.clear()
            self._run(layer, args, kwargs, None)

    def _run(self, layer, args, kwargs, device):
        from keras.src import backend

        # Keras converts a mapped weight to the current device.
        meta = device is not None
        with backend.device_scope(device) if meta else contextlib.nullcontext():
            args, kwargs = tree.map_structure(_stand_in, (args, kwargs))
            weights = [(v, _zeros(v.shape, v.dtype)) for v in layer.variables]
            _state.trace = self
            try:
                with (
                    StatelessScope(state_mapping=weights),
                    torch.no_grad(),
                    self,
                ):
                    layer.call(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - the layer's own code.
                if fallback.is_out_of_memory(error):
                    raise
                raise _CallFailed(str(error)) from error
            finally:
                _state.trace = None

    def call_layer(self, call_function, layer, args, kwargs):
        """Records what a paired kernel reads; marks outputs by role."""
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
            # An in-place op's output is an input: it keeps what it carried.
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


def _stand_in(x):
    if not isinstance(x, KerasTensor):
        return x
    shape = tuple(UNKNOWN_DIMENSION if d is None else d for d in x.shape)
    return _zeros(shape, x.dtype)


def _zeros(shape, dtype):
    from keras.src import ops

    # Zeros, not uninitialized memory: an integer weight may be an index.
    return ops.zeros(tuple(shape), dtype=dtype)
