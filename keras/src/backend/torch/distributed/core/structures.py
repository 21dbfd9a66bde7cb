"""Nested inputs and outputs mapped and flattened without `keras.tree`'s cost
on plain lists, tuples and dicts (a step maps a few per call)."""

from keras.src import tree

_SCALARS = (int, float, str, type(None))


def map_structure(function, data):
    """`tree.map_structure(function, data)`, dicts visited in sorted key order
    (the same on every process) and returned in theirs."""
    if type(data) in (list, tuple):
        return type(data)(map_structure(function, x) for x in data)
    if type(data) is dict:
        mapped = {k: map_structure(function, data[k]) for k in sorted(data)}
        return {k: mapped[k] for k in data}
    if hasattr(data, "shape") or isinstance(data, _SCALARS):
        return function(data)
    return tree.map_structure(function, data)


def flatten(data):
    """The leaves of `data`, in `map_structure`'s order."""
    leaves = []
    map_structure(leaves.append, data)
    return leaves
