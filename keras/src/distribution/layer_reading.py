"""The facts about layers `auto_plan` decides from: which layer creates a
variable, what a layer computes, `EinsumDense` letters."""

import re

from keras.src.backend.common import global_state

_EQUATION = re.compile(r"^([a-zA-Z.]+),([a-zA-Z]+)->([a-zA-Z.]+)$")


def creating_layers():
    """`(layer, parent)`: the layer creating a variable now and its parent
    (or `None`), from the `caller`s of the name scopes around `add_weight`."""
    from keras.src.layers.layer import Layer

    layers = [None, None]
    for scope in global_state.get_global_attribute("name_scope_stack") or []:
        caller = getattr(scope, "caller", None)
        if isinstance(caller, Layer) and layers[-1] is not caller:
            layers.append(caller)
    return layers[-1], layers[-2]


def layer_kind(layer):
    """What `layer` computes: embedding, einsum, dense, conv, else "layer"."""
    from keras.src import layers

    if isinstance(layer, layers.Embedding):
        return "embedding"
    if isinstance(layer, layers.EinsumDense):
        return "einsum"
    if isinstance(layer, layers.Dense):
        return "dense"
    return "conv" if "Conv" in type(layer).__name__ else "layer"


def parse_equation(equation):
    """`EinsumDense` equation's `(input, kernel, output)` letters, or `None`."""
    match = _EQUATION.match(equation.replace(" ", ""))
    return match and tuple(part.replace(".", "") for part in match.groups())


def einsum_bias_axes(layer, shape, letter, axis_name):
    """Mesh axes of an `EinsumDense` bias (shaped as the output from its first
    bias axis on) with `letter` over `axis_name`, or `None` if it lacks it."""
    parsed = parse_equation(getattr(layer, "equation", ""))
    bias_axes = getattr(layer, "bias_axes", None)
    if parsed is None or not bias_axes:
        return None
    output = parsed[2]
    first = min(output.index(c) for c in bias_axes if c in output)
    letters = output[first:]
    if len(letters) != len(shape) or letter not in letters:
        return None
    return tuple(axis_name if c == letter else None for c in letters)
