"""`AutoModelParallel`'s plan, made as each variable is created (layers build in
data-flow order): Megatron-style tensor parallelism over the model axis, FSDP-
like sharding over a batch axis. Wrong guesses cost collectives, not results."""

import math
import weakref

from keras.src.distribution import layer_reading
from keras.src.distribution import plan_axes
from keras.src.distribution import plan_pairs
from keras.src.distribution import plan_share

COLUMN = plan_pairs.COLUMN
ROW = plan_pairs.ROW
STACK = "stack"
# Projections to at most this many features starting a pair (a router, a gate)
# keep their output whole: softmax or top-k reads every feature.
NARROW_WIDTH = 256
# Fractions of the model so far that storage beyond an even share may reach:
# kernels replicated to save collectives, and all weights (past it, sharded).
REPLICATION_BUDGET = 0.03
SHARE_BOUND = 0.04


class Plan:
    """The planner's state for one distribution, on a `{axis: size}` mesh."""

    def __init__(self, mesh_shape, model_dim_name, batch_dim_name):
        self.model_size = mesh_shape[model_dim_name]
        # On a 1-D mesh only tensor parallelism shards kernels over the axis.
        same = batch_dim_name == model_dim_name
        self.batch_size = 1 if same else mesh_shape.get(batch_dim_name, 1)
        self.model_dim_name = model_dim_name
        self.batch_dim_name = batch_dim_name
        self._pairs = plan_pairs.Pairs()
        # `(role, sharded size[, letter])` of each layer's kernel, for its bias.
        self._roles = weakref.WeakKeyDictionary()
        self._batch_sharded, self._head_parallel, self._gathered_blocks = (
            weakref.WeakSet() for _ in range(3)
        )
        # Keyed by id: variables are unhashable.
        self._call_gathered = weakref.WeakValueDictionary()
        self._gathering = False
        self._mesh = plan_axes.MeshAxes(
            model_dim_name, self.model_size, batch_dim_name, self.batch_size
        )
        self._share = plan_share.PlanShare(self._mesh)

    def layout_axes(self, variable):
        """`(axes, reason)`: the mesh axis (or `None`) of each dimension of a
        new `variable`, and a short text saying what decided it."""
        self._gathering = False
        axes, reason = self._layout_axes(variable)
        if _is_float(variable.dtype):
            shape = tuple(variable.shape)
            # Used whole: gathered per call where that is the call's one gather.
            gathered = self.batch_size == 1
            axes, reason, bound = self._share.bounded(
                shape, axes, reason, SHARE_BOUND, gathered
            )
            self._gathering = self._gathering or (bound and gathered)
            self._share.record(shape, axes)
        if self._gathering and self.model_dim_name in axes:
            self._call_gathered[id(variable)] = variable
        return axes, reason

    def gathered_for_call(self, variable):
        """Whether `variable` is stored sharded but gathered for each call."""
        return self._call_gathered.get(id(variable)) is variable

    def _role(self, layer):
        return (None,) if layer is None else self._roles.get(layer, (None,))

    def kernel_role(self, layer):
        """`COLUMN`, `ROW` or `STACK`: how `layer`'s kernel is sharded."""
        return self._role(layer)[0]

    def paired_role(self, layer):
        """The role widths gave `layer`'s kernel, until checked, or `None`."""
        return getattr(self._pairs.pairings.get(layer), "role", None)

    def check_pairing(self, layer, role, weights):
        """`[(variable, axes, reason)]` for `weights` (`[(variable, axes)]`) to
        lay out anew where `layer`'s checked `role` is not what widths said."""
        pairing = self._pairs.pairings.pop(layer, None)
        if pairing is None or role == pairing.role:
            return []
        dim = pairing.orders[role][0]
        reads = "a column-parallel output" if role == ROW else "the stream"
        axes, reason = self._mesh.shard(
            pairing.shape,
            pairing.orders[role],
            lambda d: f"{pairing.describe(role, d)}: its call reads {reads}",
        )
        if axes[dim] != self.model_dim_name:
            return []
        letter = () if pairing.letters is None else (pairing.letters[dim],)
        self._roles[layer] = (role, pairing.shape[dim]) + letter
        relaid = []
        for variable, old in weights:
            shape = tuple(variable.shape)
            if variable.name == "kernel" and shape == pairing.shape:
                relaid.append((variable, axes, reason))
            elif variable.name == "bias":
                new, why = self._vector_axes(shape, layer)
                if self.batch_dim_name in old:
                    new, why = self._mesh.with_batch(shape, new, why)
                if new != tuple(old) and self._share.relaid(
                    shape, old, new, SHARE_BOUND
                ):
                    relaid.append((variable, new, why))
        return relaid

    def _layout_axes(self, variable):
        shape = tuple(variable.shape)
        if not shape:
            return (), "replicated: scalar"
        if not _is_float(variable.dtype):
            return (None,) * len(shape), "replicated: not a float tensor"
        layer, parent = layer_reading.creating_layers()
        if len(shape) == 1 or variable.name == "bias":
            axes, reason = self._vector_axes(shape, layer)
            if variable.trainable and self._gathered_with_block(layer, parent):
                return self._mesh.with_batch(shape, axes, reason)
            return axes, reason
        kind = layer_reading.layer_kind(layer)
        if kind == "embedding":
            axes, reason = self._embedding_axes(layer, shape)
        elif kind == "einsum" and variable.name == "kernel":
            axes, reason = self._einsum_axes(layer, parent, shape)
        elif kind == "layer" and (
            len(shape) > 2 or self.kernel_role(layer) == STACK
        ):
            axes, reason = self._stack_axes(layer, shape)
        else:
            # Dense, conv kernels ([..., in, out]) and any layer's own matrices.
            scope = parent if kind in ("dense", "conv") else layer
            axes, reason = self._matmul_axes(layer, scope, parent, shape, kind)
        trainable = variable.trainable and layer is not None
        if trainable and self.batch_dim_name in axes:
            self._batch_sharded.add(layer)
        return axes, reason

    def _vector_axes(self, shape, layer):
        """Bias follows its layer's sharded output; other vectors replicate."""
        replicated, role = (None,) * len(shape), self._role(layer)
        if role[0] == STACK and len(shape) > 1:
            return self._stack_axes(layer, shape)
        if role[0] != COLUMN:
            what = "vector" if len(shape) == 1 else "bias"
            return replicated, f"replicated: {what}"
        if len(role) > 2:
            axes = layer_reading.einsum_bias_axes(
                layer, shape, role[2], self.model_dim_name
            )
            if axes is not None:
                return axes, "column-parallel bias (heads)"
        elif shape[-1] == role[1]:
            axes = replicated[:-1] + (self.model_dim_name,)
            return axes, "column-parallel bias"
        return replicated, "replicated: bias"

    def _gathered_with_block(self, layer, parent):
        """Whether `layer`'s weights join a block's or kernel's batch gather."""
        if self.batch_size == 1 or not _is_block(layer):
            return False
        if layer in self._batch_sharded or _is_block(parent):
            return True
        # A block built on first call creates inner weights in its name scope.
        return any(True for _ in layer._flatten_layers(include_self=False))

    def _embedding_axes(self, layer, shape):
        vocab_dim = 0 if shape == (layer.input_dim, layer.output_dim) else 1
        order = sorted([vocab_dim, 1 - vocab_dim], key=lambda d: -shape[d])
        what = {vocab_dim: "vocabulary", 1 - vocab_dim: "features"}
        return self._mesh.shard(shape, order, lambda d: f"embedding {what[d]}")

    def _einsum_axes(self, layer, parent, shape):
        parsed = layer_reading.parse_equation(getattr(layer, "equation", ""))
        if parsed is None or len(parsed[1]) != len(shape):
            return self._matmul_axes(layer, parent, parent, shape, "einsum")
        inputs, kernel, output = parsed
        out_only = [c for c in kernel if c in output and c not in inputs]
        contracted = [c for c in kernel if c in inputs and c not in output]
        heads_out = [c for c in out_only if c != output[-1:]]
        heads_in = [c for c in contracted if c != inputs[-1:]]
        size = {c: shape[kernel.index(c)] for c in kernel}
        if parent in self._gathered_blocks:
            letters = contracted + out_only
            return self._gathered_for_call(layer, shape, kernel, letters)
        pairing = None
        if heads_out:
            self._pairs.open_width(parent, math.prod(size[c] for c in out_only))
            indivisible = all(size[c] % self.model_size for c in heads_out)
            beside_heads = self._pairs.key(parent) in self._head_parallel
            axes, batch = self._mesh.shard(shape)
            within = self._share.within(shape, axes, REPLICATION_BUDGET)
            if indivisible and beside_heads and within:
                reason = (
                    f"replicated over model: heads indivisible by "
                    f"{self.model_size} beside sharded query heads "
                    f"({layer.equation}: {''.join(heads_out)})"
                )
                return axes, f"{reason}; {batch}" if any(axes) else reason
            if indivisible and contracted and self._gathers_blocks(parent):
                if not beside_heads:
                    self._gathered_blocks.add(parent)
                return self._gathered_for_call(layer, shape, kernel, contracted)
            if indivisible and contracted:
                # Row-parallel inputs: one all-reduce of output and gradient;
                # head-dim splits cost more collectives (rotary halves, scores).
                role, letters = ROW, contracted
                what = "row-parallel over input features (heads indivisible)"
            else:
                role, letters = COLUMN, _first(heads_out, out_only)
                what = "column-parallel over heads"
        elif heads_in:
            role, letters = ROW, _first(heads_in, contracted)
            what = "row-parallel over heads"
        else:
            in_width = math.prod(size[c] for c in contracted)
            out_width = math.prod(size[c] for c in out_only)
            role, ambiguous = self._pairs.role(in_width, out_width, parent)
            letters = out_only if role == COLUMN else contracted
            what = f"{role}-parallel"
            if ambiguous:
                orders = {COLUMN: out_only, ROW: contracted}
                orders = {
                    r: list(map(kernel.index, o)) for r, o in orders.items()
                }
                pairing = plan_pairs.Pairing(
                    role, shape, orders, layer.equation, kernel
                )
        order = [kernel.index(c) for c in letters]
        axes, reason = self._mesh.shard(
            shape, order, lambda d: f"{what} ({layer.equation}: {kernel[d]})"
        )
        if self.model_dim_name in axes:
            letter = kernel[axes.index(self.model_dim_name)]
            if pairing is not None and axes[order[0]] == self.model_dim_name:
                self._pairs.pairings[layer] = pairing
            self._roles[layer] = (role, size[letter], letter)
            if role == COLUMN and letter in heads_out:
                self._head_parallel.add(self._pairs.key(parent))
        return axes, reason

    def _gathered_for_call(self, layer, shape, kernel, letters):
        """Shards the first divisible of `letters`; gathered for each call."""
        self._gathering = True
        why = "gathered for each call: its block's heads indivisible by "
        why += f"{self.model_size} ({layer.equation}: "
        order = [kernel.index(c) for c in letters]
        return self._mesh.shard(shape, order, lambda d: f"{why}{kernel[d]})")

    def _gathers_blocks(self, parent):
        """Whether `parent` is a block whose kernels no other axis gathers."""
        return self.batch_size == 1 and _is_block(parent)

    def _matmul_axes(self, layer, scope, parent, shape, kind):
        in_dim, out_dim = len(shape) - 2, len(shape) - 1
        in_width, out_width = shape[in_dim], shape[out_dim]
        widths = f"{kind} ({in_width}->{out_width})"
        reads = self._pairs.reads(in_width, (scope, parent))[0]
        # A narrow projection starting a pair, or beside the block's column
        # kernels with an output the model axis does not divide, stays whole.
        if (
            reads != ROW
            and out_width < in_width
            and out_width <= NARROW_WIDTH
            and (reads is None or out_width % self.model_size)
        ):
            reason = f"replicated over model: narrow output ({widths})"
            return self._mesh.shard(shape)[0], reason
        role, ambiguous = self._pairs.role(in_width, out_width, scope, parent)
        orders = {COLUMN: [out_dim, in_dim], ROW: [in_dim, out_dim]}
        order, what = orders[role], f"{role}-parallel {widths}"
        axes, reason = self._mesh.shard(shape, order, lambda d: what)
        if axes[order[0]] == self.model_dim_name and layer is not None:
            self._roles[layer] = (role, shape[order[0]])
            if kind in ("dense", "conv") and ambiguous:
                self._pairs.pairings[layer] = plan_pairs.Pairing(
                    role, shape, orders, widths, None
                )
        return axes, reason

    def _stack_axes(self, layer, shape):
        """Shards stacked matrices (experts), biases too, on the stack dim."""
        role = self._role(layer)
        if role[0] == STACK and shape[0] != role[1]:
            return self._mesh.shard(shape)
        axes, reason = self._mesh.shard(
            shape, [0], lambda d: f"stacked matrices ({shape[0]} experts)"
        )
        if axes[0] == self.model_dim_name and layer is not None:
            self._roles[layer] = (STACK, shape[0])
        return axes, reason


def _first(heads, letters):
    """`letters`, `heads` first."""
    return heads + [c for c in letters if c not in heads]


def _is_block(layer):
    """Whether `layer` is a layer and not a model."""
    from keras.src.models.model import Model

    return layer is not None and not isinstance(layer, Model)


def _is_float(dtype):
    return "float" in str(dtype)
