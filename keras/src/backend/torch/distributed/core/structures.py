"""Nested inputs and outputs mapped and flattened without `keras.tree`'s cost
on plain lists, tuples and dicts (a step maps a few per call)."""

from keras.src import tree

_SCALARS = (int, float, str, type(None))


def map_structure(function, data):
    """`tree.map_structure(function, data)`, dicts visited in sorted key order
    (the same on every process) and returned in theirs."""
    kind = type(data)
    if kind is list or kind is tuple:
        return kind([map_structure(function, x) for x in data])
    if kind is dict:
        mapped = {k: map_structure(function, data[k]) for k in sorted(data)}
        return {k: mapped[k] for k in data}
    if hasattr(data, "shape") or isinstance(data, _SCALARS):
        return function(data)
    return tree.map_structure(function, data)


def flatten(data):
    """The leaves of `data`, in `map_structure`'s order."""
    leaves = []
    _add_leaves(leaves, data)
    return leaves


def _add_leaves(leaves, data):
    """Appends the leaves of `data` to `leaves`, in `map_structure`'s order."""
    kind = type(data)
    if kind is list or kind is tuple:
        for x in data:
            _add_leaves(leaves, x)
    elif kind is dict:
        for key in sorted(data):
            _add_leaves(leaves, data[key])
    elif hasattr(data, "shape") or isinstance(data, _SCALARS):
        leaves.append(data)
    else:
        tree.map_structure(leaves.append, data)
