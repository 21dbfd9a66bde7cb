"""Which kernel reads which, as `AutoModelParallel` plans it: column and row
pairs, from widths alone.

The planner (`auto_plan`) decides each kernel's layout at its creation, in
the order data flows through the layers (see `auto_plan`). Within one
enclosing layer, a kernel that reads the block's stream is column parallel
and leaves its output width "open"; a later kernel whose input has an open
width consumes that output, through whatever elementwise ops lie between,
and is row parallel. `Pairs` keeps, per enclosing layer, the widths
column-parallel kernels read and the widths they left open.

Widths cannot always tell: where a block's feed-forward layers are as wide
as the block (a tiny config), a kernel reading a column kernel's output
has the stream's width too. Each kernel paired by widths keeps its
`Pairing`, how to lay it out either way, until a backend that can follow
the block's data to its first call (torch) checks what the kernel reads
(`AutoModelParallel.check_pairing`).
"""

import weakref

# Roles a kernel can take in a pair.
COLUMN = "column"
ROW = "row"


class Pairs:
    """The widths read and left open by column-parallel kernels, per
    enclosing layer (`None`: layers created outside any layer)."""

    def __init__(self):
        # Widths left open by column-parallel layers, per enclosing layer.
        self._open = weakref.WeakKeyDictionary()
        # Widths column-parallel layers read, per enclosing layer.
        self._stream = weakref.WeakKeyDictionary()
        # The root of layers created outside any other layer.
        self._root = _Root()
        # The `Pairing` of each kernel paired by widths, until checked.
        self._pairings = weakref.WeakKeyDictionary()

    def key(self, layer):
        """`layer`, or the root standing for "outside any layer"."""
        return self._root if layer is None else layer

    def reads(self, in_width, scope, fallback):
        """`COLUMN` if a kernel of `in_width` reads the block's stream,
        `ROW` if it reads an open width, else `None` (it starts a pair)."""
        for key in (scope, fallback):
            if in_width in self._stream.get(self.key(key), set()):
                return COLUMN
            if in_width in self._open.get(self.key(key), set()):
                return ROW
        return None

    def ambiguous(self, in_width, scope, fallback=None):
        """Whether widths cannot tell what a kernel of `in_width` reads: an
        earlier column kernel read that width and another left it open."""
        keys = [self.key(k) for k in (scope, fallback)]
        return any(in_width in self._stream.get(k, ()) for k in keys) and any(
            in_width in self._open.get(k, ()) for k in keys
        )

    def role(self, scope, in_width, out_width, fallback=None):
        """Column or row parallel, from what a kernel reads.

        A kernel reading the width an earlier column kernel of `scope` read
        (the block's stream: query, key and value; gate and up) is column
        parallel too; one reading a width an earlier column kernel left open
        consumes its output and is row parallel; any other starts a pair.
        """
        for key in (scope, fallback):
            if in_width in self._stream.get(self.key(key), set()):
                self.open_width(scope, out_width)
                return COLUMN
            open_widths = self._open.get(self.key(key), set())
            if in_width in open_widths:
                open_widths.discard(in_width)
                return ROW
        self._stream.setdefault(self.key(scope), set()).add(in_width)
        self.open_width(scope, out_width)
        return COLUMN

    def open_width(self, scope, width):
        """Leaves `width` open in `scope`: a later kernel reading it is row
        parallel."""
        widths = self._open.setdefault(self.key(scope), set())
        widths.add(width)
        # A fused projection split in halves (gate and up) feeds one half.
        if width % 2 == 0:
            widths.add(width // 2)

    def record(self, layer, pairing):
        """Keeps how `layer`'s kernel, paired by widths, lays out either
        way, until a call checks it."""
        self._pairings[layer] = pairing

    def pairing(self, layer):
        """`layer`'s unchecked `Pairing`, or `None`."""
        return self._pairings.get(layer)

    def checked(self, layer):
        """Forgets `layer`'s `Pairing`: a call has checked it."""
        return self._pairings.pop(layer, None)


class Pairing:
    """How a kernel paired by widths alone lays out as either role.

    Args:
        role: the role its widths gave it.
        shape: the kernel's shape.
        orders: `{role: dimensions to shard, in order of preference}`.
        describe: `describe(role, dimension)`, the reason's text.
        letters: an `EinsumDense` kernel's letters (its bias follows the
            one sharded), else `None`.
    """

    def __init__(self, role, shape, orders, describe, letters=None):
        self.role = role
        self.shape = shape
        self.orders = orders
        self.describe = describe
        self.letters = letters


def matmul_pairing(role, shape, kind):
    """The `Pairing` of a dense or convolution kernel (input and output
    features last)."""
    in_dim, out_dim = len(shape) - 2, len(shape) - 1
    widths = f"{shape[in_dim]}->{shape[out_dim]}"
    return Pairing(
        role,
        shape,
        {COLUMN: [out_dim, in_dim], ROW: [in_dim, out_dim]},
        lambda r, d: f"{r}-parallel {kind} ({widths})",
    )


def einsum_pairing(role, shape, equation, kernel, out_only, contracted):
    """The `Pairing` of an `EinsumDense` kernel (letters `kernel`) with no
    head letters: column parallel over the letters only its output has,
    row parallel over those it contracts."""
    return Pairing(
        role,
        shape,
        {
            COLUMN: [kernel.index(c) for c in out_only],
            ROW: [kernel.index(c) for c in contracted],
        },
        lambda r, d: f"{r}-parallel ({equation}: {kernel[d]})",
        letters=kernel,
    )


class _Root:
    """The enclosing "layer" of layers created outside any layer."""
