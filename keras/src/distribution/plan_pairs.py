"""Column/row kernel pairs for `auto_plan`, from widths alone: within an
enclosing layer, a kernel reading the block's stream is column parallel and
leaves its output width "open"; a later one reading an open width is row
parallel. Ambiguous widths (feed-forward as wide as the block) keep a `Pairing`
until the first call checks it (`AutoModelParallel.check_pairing`)."""

import collections
import weakref

COLUMN = "column"
ROW = "row"


class Pairing(
    collections.namedtuple("Pairing", "role shape orders label letters")
):
    """How a kernel paired by widths alone (as `role`) lays out as either
    role: `orders` maps each to the dimensions to shard, by preference;
    `label`: its kind and widths, or an `EinsumDense`'s equation (`letters`:
    its kernel's)."""

    def describe(self, role, dim):
        if self.letters is None:
            return f"{role}-parallel {self.label}"
        return f"{role}-parallel ({self.label}: {self.letters[dim]})"


class Pairs:
    """Widths read and left open by column kernels, per enclosing layer (this
    object standing for "outside any layer"); `pairings`: the unchecked
    `Pairing` of each ambiguous kernel's layer."""

    def __init__(self):
        self._open = weakref.WeakKeyDictionary()
        self._stream = weakref.WeakKeyDictionary()
        self.pairings = weakref.WeakKeyDictionary()

    def key(self, layer):
        return self if layer is None else layer

    def _read(self, in_width, scopes):
        """`(COLUMN, None)` if the first of `scopes` holding `in_width` has it
        as the stream, `(ROW, its open widths)` if open, else `(None, None)`."""
        for key in map(self.key, scopes):
            if in_width in self._stream.get(key, ()):
                return COLUMN, None
            if in_width in self._open.get(key, ()):
                return ROW, self._open[key]
        return None, None

    def reads(self, in_width, scope, fallback):
        """`COLUMN` (reads the stream), `ROW` (an open width) or `None`."""
        return self._read(in_width, (scope, fallback))[0]

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
        role, open_widths = self._read(in_width, (scope, fallback))
        if role == ROW:
            open_widths.discard(in_width)
            return ROW
        if role is None:
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
