"""A tensor-parallel plan for any model, decided as each variable is created.

`AutoModelParallel` (`auto_parallel.py`) asks this planner for the layout of
every variable that no `LayoutMap` rule lays out. The plan is Megatron-style
tensor parallelism over the mesh's model axis, plus, where the mesh has a
batch axis longer than one, the kernel's largest other dimension sharded
over it (as keras-hub's hand-written maps do: FSDP-like), and the vectors
of a block (norm scales, biases) too: a block's call gathers all of its
weights in one collective, so they cost no collective of their own.

When: at variable creation. keras-hub's `from_preset` creates (and then
loads) every variable in the model's constructor, and a model's variables
must be laid out when they are created: under JAX an array is placed once,
and under torch a variable created replicated and re-laid out later would
hold the whole model on every process first, and its optimizer slots would
have to move with it. Deciding at creation keeps every process' memory at
its share from the start, and optimizer slots inherit their variable's
layout (`add_variable_from_reference`). A model cannot be traced before it
exists (a preset's constructor builds it).

What it reads (`layer_reading`): the layer that creates the variable (Keras
opens a name scope with the layer as its caller around `add_weight`) and the
layer around it.
Keras builds layers in the order data flows through them: a functional or
`Sequential` model builds each layer when it is called on its symbolic
inputs, a subclassed model or block builds its sublayers at its first call
or in its `build`, in call order. Within one enclosing layer, a kernel
reading the block's stream is column parallel (its output features
sharded) and a later one reading that output, through whatever elementwise
ops lie between, row parallel: one all-reduce per pair (`plan_pairs`).
Where widths cannot tell (a feed-forward layer as wide as its block), a
backend that can follow data through a call checks each kernel widths
paired at its block's first symbolic call, before weights are loaded or
optimizer slots made, and lays it out again if it reads otherwise
(`check_pairing`; torch traces the call on stand-ins). Layers explain
themselves where they can: an `EinsumDense` equation says which
kernel dimensions are heads (a dimension of the output that is not its
feature axis: column parallel over heads; one contracted from the input
that is not the input's feature axis: row parallel over heads), an
`Embedding` shards its vocabulary (or its features when the vocabulary is
the smaller or indivisible). Vectors and scalars (norm scales, biases of
row-parallel layers, counters) stay replicated over the model axis; a
column-parallel layer's bias follows its output features.

Heads the model axis does not divide (Gemma's single key/value head) are
not sharded unevenly, nor is their head size sharded instead. Beside query
heads sharded over the model axis, their kernel is replicated over it, as
Megatron-LM does for key/value heads, while the memory this costs stays
within `REPLICATION_BUDGET` of the model created so far: each process
computes the key/value heads whole and no collective is added, since
their gradients, partial sums over the query heads, join the query's.
Past the budget (a tiny model, whose key/value heads are a sizeable part
of it), the kernel is stored sharded and gathered whole for each call of
its block (`gathered_for_call`: ZeRO-3, as FSDP gathers a module's
weights), in one collective with the block's other gathered weights. Query
heads the axis does not divide make every einsum kernel of their block
gathered so: none of its projections can split heads, and splitting their
input features costs an all-reduce each, forward and backward. Where the
batch axis is longer than one, kernels are gathered along it for each call
already, and a second gather costs more (measured): there the projection
splits its input features, as a row-parallel layer does, and the heads are
computed whole from an all-reduced output. Any other dimension the model
axis does not divide gives way to the kernel's next candidate dimension.

What every process stores beyond an even share (replicated vectors,
narrow projections, key/value heads) is kept within `SHARE_BOUND` of the
model created so far: past it, a weight the plan would replicate over the
model axis is sharded over it instead, ZeRO-like (gathered whole for each
call of its layer or block; with a batch axis, where it is used). Only a
tiny config (width 16) reaches the bound; a preset stays well inside it.

The plan decides only where data lives, never what is computed: any layout
gives one process' numbers, so a plan that guesses a pairing wrong costs
collectives, not correctness.
"""

import math
import weakref

from keras.src.distribution import layer_reading
from keras.src.distribution import plan_axes
from keras.src.distribution import plan_pairs
from keras.src.distribution import plan_share

# Roles a kernel can take in the plan.
COLUMN = plan_pairs.COLUMN
ROW = plan_pairs.ROW
STACK = "stack"
# A projection to at most this many features that reads a width no column
# layer left open (a router, a gate, a classifier head) keeps its output
# whole: its consumer (softmax, top-k) reads every feature.
NARROW_WIDTH = 256
# A kernel replicated over the model axis to save collectives (key/value
# heads) may bring the parameters each process stores beyond an even
# share to at most this fraction of the model created so far. Keeps the
# whole model's excess, norms and biases included, well inside 5%.
REPLICATION_BUDGET = 0.03
# What each process stores beyond an even share may reach at most this
# fraction of the model created so far (the acceptance bound is 5%): past
# it, a weight the plan would replicate over the model axis (a norm scale,
# a row-parallel bias, a narrow projection) is sharded over it instead, and
# gathered where it is used. Only a model whose replicated weights are a
# sizeable part of it (a tiny config) comes near it.
SHARE_BOUND = 0.04


class Plan:
    """The planner's state for one distribution.

    Args:
        mesh_shape: `{axis name: size}` of the device mesh.
        model_dim_name: the mesh axis tensor parallelism shards over.
        batch_dim_name: the mesh axis the batch is split over; kernels are
            also sharded over it (on another dimension) when it is longer
            than one.
    """

    def __init__(self, mesh_shape, model_dim_name, batch_dim_name):
        self.model_size = mesh_shape[model_dim_name]
        # On a 1-D mesh the batch and the model share the one axis: only
        # tensor parallelism shards kernels over it.
        self.batch_size = (
            mesh_shape.get(batch_dim_name, 1)
            if batch_dim_name != model_dim_name
            else 1
        )
        self.model_dim_name = model_dim_name
        self.batch_dim_name = batch_dim_name
        # Which kernel reads which: column and row pairs.
        self._pairs = plan_pairs.Pairs()
        # The role and sharded size of each layer's kernel, for its bias.
        self._roles = weakref.WeakKeyDictionary()
        # Layers with a trainable kernel sharded over the batch axis.
        self._batch_sharded = weakref.WeakSet()
        # Layers whose attention heads are sharded (a query kernel's).
        self._head_parallel = weakref.WeakSet()
        # Blocks whose einsum kernels are gathered for each call.
        self._gathered_blocks = weakref.WeakSet()
        # The variables gathered for each call, by id (Keras variables
        # are not hashable): a weak reference to each.
        self._call_gathered = {}
        self._gathering = False
        # Where the model and batch axes go on a variable's dimensions.
        self._mesh = plan_axes.MeshAxes(
            model_dim_name, self.model_size, batch_dim_name, self.batch_size
        )
        # What each process stores beyond an even share, so far.
        self._share = plan_share.PlanShare(self._mesh)

    def layout_axes(self, variable):
        """The mesh axes of each dimension of `variable`, and why.

        Args:
            variable: a Keras variable being created.

        Returns:
            `(axes, reason)`: a tuple of mesh axis names (or `None`), one per
            dimension, and a short text saying what decided it.
        """
        self._gathering = False
        axes, reason = self._layout_axes(variable)
        if _is_float(variable.dtype):
            shape = tuple(variable.shape)
            # Used whole, as it would have been replicated: gathered with
            # its layer's call where that is the call's one gather.
            axes, reason, bound = self._share.bounded(
                shape, axes, reason, SHARE_BOUND, self.batch_size == 1
            )
            self._gathering = self._gathering or (
                bound and self.batch_size == 1
            )
            self._share.record(shape, axes)
        if self._gathering and self.model_dim_name in axes:
            self._call_gathered[id(variable)] = weakref.ref(variable)
        return axes, reason

    def gathered_for_call(self, variable):
        """Whether `variable` is stored sharded over the model axis but
        used whole: gathered for each call of the block holding it."""
        ref = self._call_gathered.get(id(variable))
        return ref is not None and ref() is variable

    def kernel_role(self, layer):
        """`COLUMN`, `ROW` or `STACK`: how `layer`'s kernel is sharded."""
        role = self._roles.get(layer) if layer is not None else None
        return None if role is None else role[0]

    def paired_role(self, layer):
        """The role widths gave `layer`'s kernel, until checked, or `None`."""
        pairing = self._pairs.pairing(layer)
        return None if pairing is None else pairing.role

    def check_pairing(self, layer, role, weights):
        """Lays `layer`'s weights out as `role`, what its first call shows
        its kernel to be, where its widths paired it otherwise.

        Args:
            layer: a layer with a `paired_role`.
            role: `ROW` if the call reads a column-parallel kernel's output
                (through elementwise ops), else `COLUMN`.
            weights: `[(variable, axes)]`: `layer`'s weights as laid out.

        Returns:
            `[(variable, axes, reason)]` for the weights laid out anew.
        """
        pairing = self._pairs.checked(layer)
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
                new, why = self._vector_axes(variable, layer)
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
            axes, reason = self._vector_axes(variable, layer)
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
            # Dense kernels, convolution kernels (the last two dimensions
            # are input and output channels) and any layer's own matrices.
            scope = parent if kind in ("dense", "conv") else layer
            axes, reason = self._matmul_axes(layer, scope, parent, shape, kind)
        if (
            variable.trainable
            and self.batch_dim_name in axes
            and layer is not None
        ):
            self._batch_sharded.add(layer)
        return axes, reason

    # Layers, one kind at a time.

    def _vector_axes(self, variable, layer):
        """A bias follows its layer's sharded output; other vectors are
        replicated."""
        shape = tuple(variable.shape)
        replicated = (None,) * len(shape)
        role = self._roles.get(layer) if layer is not None else None
        if role is not None and role[0] == STACK and len(shape) > 1:
            return self._stack_axes(layer, shape)
        if role is None or role[0] != COLUMN:
            return replicated, "replicated: " + (
                "vector" if len(shape) == 1 else "bias"
            )
        if len(role) > 2:
            axes = layer_reading.einsum_bias_axes(
                layer, shape, role[2], self.model_dim_name
            )
            if axes is not None:
                return axes, "column-parallel bias (heads)"
        elif shape[-1] == role[1]:
            return replicated[:-1] + (self.model_dim_name,), (
                "column-parallel bias"
            )
        return replicated, "replicated: bias"

    def _gathered_with_block(self, layer, parent):
        """Whether a call gathers `layer`'s weights over the batch axis
        with others: the weights of a block (a layer, not a model, with
        layers inside) and of its layers are gathered in the block's one
        collective, and a layer's vector in the collective of its own
        batch-sharded kernel."""
        if self.batch_size == 1 or not _is_block(layer):
            return False
        if layer in self._batch_sharded or _is_block(parent):
            return True
        # A block built on its first call creates its layers' weights in
        # its own name scope.
        return any(True for _ in layer._flatten_layers(include_self=False))

    def _embedding_axes(self, layer, shape):
        vocab_dim = 0 if shape == (layer.input_dim, layer.output_dim) else 1
        order = [vocab_dim, 1 - vocab_dim]
        if shape[1 - vocab_dim] > shape[vocab_dim]:
            order.reverse()
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
            return self._gathered_for_call(layer, shape, contracted + out_only)
        if heads_out:
            self._pairs.open_width(parent, math.prod(size[c] for c in out_only))
            indivisible = self._indivisible(heads_out, size)
            if (
                indivisible
                and self._pairs.key(parent) in self._head_parallel
                and self._within_budget(shape)
            ):
                axes, batch = self._mesh.shard(shape, [], str, model=False)
                reason = (
                    f"replicated over model: heads indivisible by "
                    f"{self.model_size} beside sharded query heads "
                    f"({layer.equation}: {''.join(heads_out)})"
                )
                return axes, f"{reason}; {batch}" if any(axes) else reason
            if indivisible and contracted and self._gathers_blocks(parent):
                if self._pairs.key(parent) not in self._head_parallel:
                    self._gathered_blocks.add(parent)
                return self._gathered_for_call(layer, shape, contracted)
            if indivisible and contracted:
                # Heads the model axis does not divide (Gemma's one
                # key/value head) are computed whole, from input features
                # split as a row-parallel layer's: one all-reduce of the
                # output, and one of its gradient where sharded query heads
                # read it. Splitting the head size instead splits every
                # attention score into partial sums: the rotary embedding's
                # halves and the scores (the size of the attention matrix)
                # would each take a collective.
                role, letters = ROW, contracted
                what = "row-parallel over input features (heads indivisible)"
            else:
                role, letters = (
                    COLUMN,
                    heads_out + [c for c in out_only if c not in heads_out],
                )
                what = "column-parallel over heads"
        elif heads_in:
            role, letters = (
                ROW,
                heads_in + [c for c in contracted if c not in heads_in],
            )
            what = "row-parallel over heads"
        else:
            in_width = math.prod(size[c] for c in contracted)
            out_width = math.prod(size[c] for c in out_only)
            ambiguous = self._pairs.ambiguous(in_width, parent)
            role = self._pairs.role(parent, in_width, out_width)
            letters = out_only if role == COLUMN else contracted
            what = f"{role}-parallel"
            pairing = plan_pairs.einsum_pairing(
                role, shape, layer.equation, kernel, out_only, contracted
            )
        order = [kernel.index(c) for c in letters]
        axes, reason = self._mesh.shard(
            shape, order, lambda d: f"{what} ({layer.equation}: {kernel[d]})"
        )
        sharded = [
            kernel[d] for d, a in enumerate(axes) if a == self.model_dim_name
        ]
        if sharded and not (heads_out or heads_in) and ambiguous:
            if axes[order[0]] == self.model_dim_name:
                self._pairs.record(layer, pairing)
        if sharded:
            self._roles[layer] = (role, size[sharded[0]], sharded[0])
            if role == COLUMN and sharded[0] in heads_out:
                self._head_parallel.add(self._pairs.key(parent))
        return axes, reason

    def _gathered_for_call(self, layer, shape, letters):
        """Stored sharded on the first of `letters` the model axis divides,
        gathered whole for each call of its block."""
        kernel = layer_reading.parse_equation(layer.equation)[1]
        self._gathering = True
        return self._mesh.shard(
            shape,
            [kernel.index(c) for c in letters],
            lambda d: (
                f"gathered for each call: its block's heads indivisible "
                f"by {self.model_size} ({layer.equation}: {kernel[d]})"
            ),
        )

    def _gathers_blocks(self, parent):
        """Whether the kernels of `parent` can be gathered for each call:
        it is a block, and its kernels are gathered along no other axis."""
        return self.batch_size == 1 and _is_block(parent)

    def _indivisible(self, heads, size):
        return all(size[c] % self.model_size for c in heads)

    def _within_budget(self, shape):
        """Whether replicating a kernel of `shape` over the model axis keeps
        the excess within `REPLICATION_BUDGET` of the model so far."""
        axes = self._mesh.shard(shape, [], lambda d: "", model=False)[0]
        return self._share.within(shape, axes, REPLICATION_BUDGET)

    def _matmul_axes(self, layer, scope, parent, shape, kind):
        in_dim, out_dim = len(shape) - 2, len(shape) - 1
        in_width, out_width = shape[in_dim], shape[out_dim]
        reads = self._pairs.reads(in_width, scope, parent)
        # A narrow projection starting a pair, or one beside the block's
        # column kernels whose output the model axis does not divide (a
        # gate of one feature), keeps its output whole.
        if (
            reads != ROW
            and _is_narrow(in_width, out_width)
            and (reads is None or out_width % self.model_size)
        ):
            return (
                self._mesh.shard(shape, [], lambda d: "", model=False)[0],
                f"replicated over model: narrow output ({kind} "
                f"{in_width}->{out_width})",
            )
        ambiguous = self._pairs.ambiguous(in_width, scope, parent)
        role = self._pairs.role(scope, in_width, out_width, fallback=parent)
        order = [out_dim, in_dim] if role == COLUMN else [in_dim, out_dim]
        axes, reason = self._mesh.shard(
            shape,
            order,
            lambda d: (
                f"{role}-parallel {kind} ({shape[in_dim]}->{shape[out_dim]})"
            ),
        )
        if axes[order[0]] == self.model_dim_name and layer is not None:
            self._roles[layer] = (role, shape[order[0]])
            if kind in ("dense", "conv") and ambiguous:
                pairing = plan_pairs.matmul_pairing(role, shape, kind)
                self._pairs.record(layer, pairing)
        return axes, reason

    def _stack_axes(self, layer, shape):
        """A layer's stack of matrices (experts) is split between processes,
        each multiplying whole matrices: the stacking dimension is sharded,
        for all the layer's weights that share it (biases included)."""
        if (
            self.kernel_role(layer) == STACK
            and shape[0] != self._roles[layer][1]
        ):
            return self._mesh.shard(shape, [], lambda d: "")
        axes, reason = self._mesh.shard(
            shape, [0], lambda d: f"stacked matrices ({shape[0]} experts)"
        )
        if axes[0] == self.model_dim_name and layer is not None:
            self._roles[layer] = (STACK, shape[0])
        return axes, reason


def _is_block(layer):
    """Whether `layer` is a layer and not a model."""
    from keras.src.models.model import Model

    return layer is not None and not isinstance(layer, Model)


def _is_narrow(in_width, out_width):
    return out_width < in_width and out_width <= NARROW_WIDTH


def _is_float(dtype):
    return "float" in str(dtype)
