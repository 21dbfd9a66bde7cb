"""Column/row kernel pairs for `auto_plan`, from widths alone.

Within an enclosing layer, a kernel reading the block's stream is column
parallel and leaves its output width "open"; a later one reading an open width
is row parallel. Ambiguous widths (feed-forward as wide as the block) keep a
`Pairing` until the first call checks it (`AutoModelParallel.check_pairing`).
"""

import weakref

COLUMN = "column"
ROW = "row"


class Pairs:
    """Widths read and left open by column kernels, per enclosing layer."""

    def __init__(self):
        self._open = weakref.WeakKeyDictionary()
        self._stream = weakref.WeakKeyDictionary()
        self._root = _Root()
        self._pairings = weakref.WeakKeyDictionary()

    def key(self, layer):
        """`layer`, or the root standing for "outside any layer"."""
        return self._root if layer is None else layer

    def reads(self, in_width, scope, fallback):
        """`COLUMN` (reads the stream), `ROW` (an open width) or `None`."""
        for key in (scope, fallback):
            if in_width in self._stream.get(self.key(key), set()):
                return COLUMN
            if in_width in self._open.get(self.key(key), set()):
                return ROW
        return None

    def ambiguous(self, in_width, scope, fallback=None):
        """Whether column kernels both read and left open `in_width`."""
        keys = [self.key(k) for k in (scope, fallback)]
        return any(in_width in self._stream.get(k, ()) for k in keys) and any(
            in_width in self._open.get(k, ()) for k in keys
        )

    def role(self, scope, in_width, out_width, fallback=None):
        """Column or row parallel, from what a kernel reads; records it. The
        stream (query/key/value, gate/up) means column, an open width row;
        anything else starts a pair."""
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
        """Leaves `width` open in `scope`, for a later row kernel."""
        widths = self._open.setdefault(self.key(scope), set())
        widths.add(width)
        # A fused projection split in halves (gate and up) feeds one half.
        if width % 2 == 0:
            widths.add(width // 2)

    def record(self, layer, pairing):
        """Keeps `layer`'s `Pairing` until a call checks it."""
        self._pairings[layer] = pairing

    def pairing(self, layer):
        """`layer`'s unchecked `Pairing`, or `None`."""
        return self._pairings.get(layer)

    def checked(self, layer):
        """Forgets `layer`'s `Pairing`: a call has checked it."""
        return self._pairings.pop(layer, None)


class Pairing:
    """How a kernel paired by widths alone (as `role`) lays out as either
    role: `orders` maps each to the dimensions to shard, by preference;
    `describe(role, dim)` gives the reason; `letters`: an `EinsumDense`'s."""

    def __init__(self, role, shape, orders, describe, letters=None):
        self.role = role
        self.shape = shape
        self.orders = orders
        self.describe = describe
        self.letters = letters


def matmul_pairing(role, shape, kind):
    """The `Pairing` of a dense or convolution kernel (features last)."""
    in_dim, out_dim = len(shape) - 2, len(shape) - 1
    widths = f"{shape[in_dim]}->{shape[out_dim]}"
    return Pairing(
        role,
        shape,
        {COLUMN: [out_dim, in_dim], ROW: [in_dim, out_dim]},
        lambda r, d: f"{r}-parallel {kind} ({widths})",
    )


def einsum_pairing(role, shape, equation, kernel, out_only, contracted):
    """The `Pairing` of a headless `EinsumDense` kernel (letters `kernel`):
    column parallel over output-only letters, row over contracted ones."""
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
