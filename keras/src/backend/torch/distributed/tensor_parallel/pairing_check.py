"""The auto plan's column and row pairs, checked at a block's first symbolic
call against what its layers read (width alone cannot tell a kernel reading
another's output from one reading the stream); a mismatch is laid out again."""

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
from keras.src.backend.torch.distributed.dtensor_gaps import global_values

UNKNOWN_DIMENSION = 8  # Small: a block the meta device fails runs on zeros.
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
        return _check(layer, distribution, reads)
    inners = layer._flatten_layers(include_self=False)
    paired = [(inner, distribution.paired_role(inner)) for inner in inners]
    paired = [(inner, role) for inner, role in paired if role is not None]
    if not paired:
        return
    trace, failure = _Trace(distribution), None
    try:
        trace.run(layer, args, kwargs)
    except _CallFailed as error:
        failure = str(error)
    # Processes lay out alike (a collective) even where the block fails on some.
    if runtime.world_size() > 1 and collectives.any_process(failure, None):
        failure = failure or "it failed on another process"
    if failure is not None:
        message = "pairings of %s not checked: its trace failed (%s)"
        runtime.log_debug(message, layer.name, failure)
        trace.reads.clear()
    # Unreached kernels keep width pairings; no outer model retraces the block.
    for inner, role in paired:
        _check(inner, distribution, trace.reads.get(inner, role == ROW))


def _check(layer, distribution, reads_column_output):
    """Lays out again the kernels of `layer` its check moves, in place."""
    for variable, layout in distribution.check_pairing(
        layer, reads_column_output
    ):
        value = variable._value
        if isinstance(value, DTensor):
            torch_layout = layouts.as_torch_layout(layout)
            mesh = torch_layout.device_mesh
            whole = value.detach().redistribute(mesh, [Replicate()] * mesh.ndim)
            moved = whole.redistribute(mesh, torch_layout.placements)
            parameter = torch.nn.Parameter(moved, value.requires_grad)
            torch.utils.swap_tensors(value, parameter)
            variable._layout = layout
        runtime.log_debug(
            "variable %s laid out again: %s", variable.path, layout.axes
        )


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
        flatten = getattr(operation, "_flatten_layers", None)
        if role is not None or (flatten and flatten(include_self=False)):
            continue  # Row-parallel, stacked and block outputs are whole.
        node = operation._inbound_nodes[history.node_index]
        pending.extend(node.input_tensors)
    return False


class _CallFailed(Exception):
    """A block's call failed on stand-ins (it reads their values)."""


class _Trace(TorchFunctionMode):
    """Runs a block on stand-ins, tracking the column kernels each tensor
    reads; `reads`: whether each width-paired layer reads a column output."""

    def __init__(self, distribution):
        super().__init__()
        self.distribution = distribution

    def run(self, layer, args, kwargs):
        """Calls `layer` on stand-ins on the meta device, else on zeros on the
        current one; `_CallFailed` if both fail."""
        from keras.src import backend

        # Keras converts a mapped weight to the current device.
        for scope in (backend.device_scope("meta"), contextlib.nullcontext()):
            self.reads, self._carried = weakref.WeakKeyDictionary(), {}
            with scope:
                stand_ins = tree.map_structure(
                    lambda x: _zeros(x) if isinstance(x, KerasTensor) else x,
                    (args, kwargs),
                )
                weights = [(v, _zeros(v)) for v in layer.variables]
                _state.trace = self
                try:
                    stateless = StatelessScope(state_mapping=weights)
                    with stateless, torch.no_grad(), self:
                        layer.call(*stand_ins[0], **stand_ins[1])
                    return
                except Exception as error:  # noqa: BLE001 - the layer's code.
                    if fallback.is_out_of_memory(error):
                        raise
                    failure = error
                finally:
                    _state.trace = None
        raise _CallFailed(str(failure)) from failure

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
        if role is not None:
            column = (id(layer),) if role == COLUMN else ()
            self._mark(outputs, frozenset(column))
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
        for x in global_values.leaves(values):
            entry = self._carried.get(id(x))
            if entry is not None and entry[0]() is x:
                carried |= entry[1]
        return carried

    def _mark(self, values, carried):
        """Records that tensors `values` are computed from `carried`."""
        for x in global_values.leaves(values):
            if isinstance(x, torch.Tensor):
                self._carried[id(x)] = (weakref.ref(x), carried)


def _zeros(x):
    """Zeros (an int weight may be an index) like `x`, unknown dims small."""
    from keras.src import ops

    shape = tuple(UNKNOWN_DIMENSION if d is None else d for d in x.shape)
    return ops.zeros(shape, dtype=x.dtype)
