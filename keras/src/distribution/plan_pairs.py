"""Column/row kernel pairs for `auto_plan`, from widths: a kernel reading its
block's stream is column parallel, one reading a width a column kernel left open
row parallel; ambiguous widths keep a `Pairing` until the first call checks."""

import collections
import weakref

COLUMN = "column"
ROW = "row"


class Pairing(
    collections.namedtuple("Pairing", "role shape orders label letters")
):
    """A kernel paired by widths alone (as `role`): `orders` maps each role to
    the dimensions to shard, by preference; `label`, its kind and widths or an
    `EinsumDense`'s equation (`letters`: its kernel's)."""

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

    def reads(self, in_width, scopes):
        """`(COLUMN, None)` if the first of `scopes` holding `in_width` has it
        as the stream, `(ROW, its open widths)` if open, else `(None, None)`."""
        for key in map(self.key, scopes):
            if in_width in self._stream.get(key, ()):
                return COLUMN, None
            if in_width in self._open.get(key, ()):
                return ROW, self._open[key]
        return None, None

    def role(self, in_width, out_width, scope, fallback=None):
        """`(role, ambiguous)`, recorded: the stream (query/key/value, gate/up)
        means column, an open width row, anything else starts a pair;
        ambiguous if column kernels both read and left open `in_width`."""
        keys = [self.key(scope), self.key(fallback)]
        ambiguous = all(
            any(in_width in widths.get(key, ()) for key in keys)
            for widths in (self._stream, self._open)
        )
        role, open_widths = self.reads(in_width, keys)
        if role == ROW:
            open_widths.discard(in_width)
            return ROW, ambiguous
        if role is None:
            self._stream.setdefault(keys[0], set()).add(in_width)
        self.open_width(scope, out_width)
        return COLUMN, ambiguous

    def open_width(self, scope, width):
        """Leaves `width` open in `scope`, for a later row kernel."""
        widths = self._open.setdefault(self.key(scope), set())
        widths.add(width)
        # A fused projection split in halves (gate and up) feeds one half.
        if width % 2 == 0:
            widths.add(width // 2)
