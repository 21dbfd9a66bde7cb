"""Which kernel reads which, as `AutoModelParallel` plans it: column and row
pairs, from widths alone.

The planner (`auto_plan`) decides each kernel's layout at its creation, in
the order data flows through the layers (see `auto_plan`). Within one
enclosing layer, a kernel that reads the block's stream is column parallel
and leaves its output width "open"; a later kernel whose input has an open
width consumes that output, through whatever elementwise ops lie between,
and is row parallel. `Pairs` keeps, per enclosing layer, the widths
column-parallel kernels read and the widths they left open.
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


class _Root:
    """The enclosing "layer" of layers created outside any layer."""
