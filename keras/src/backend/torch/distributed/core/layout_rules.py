"""Which `LayoutMap` rule lays out each variable, and rules that lay out none.

A rule whose key matches no variable path (a typo, a layer renamed since the
rule was written) leaves the variables it was meant for replicated: a full
copy on every process. Nothing fails until a large model runs out of memory,
so a model is checked once, when first called under a `ModelParallel`
distribution, and the rules that matched none of its variables are named in
a warning.
"""

import re
import warnings
import weakref

# Keras looks up the layout of a layer's outputs at "<layer path>/output":
# rules for those lay out no variable.
OUTPUT_SUFFIX = "/output"
# Variable paths quoted in the warning, as examples of what rules match.
NUM_EXAMPLE_PATHS = 5

# The models checked, per distribution (both weakly referenced).
_checked_models = weakref.WeakKeyDictionary()


def layout_map_of(distribution):
    """The `LayoutMap` of a `ModelParallel` distribution, else `None`."""
    # `ModelParallel` keeps its map private; it has no public accessor.
    return getattr(distribution, "_layout_map", None)


def matching_rule(layout_map, path):
    """The key of `layout_map` that lays out `path`, as `LayoutMap` finds it.

    Args:
        layout_map: a `keras.distribution.LayoutMap`.
        path: a variable path.

    Returns:
        The key: `path` itself, else the one key that matches it as a
        regular expression; `None` when none (or, which `LayoutMap` refuses,
        several) match.
    """
    # Not `path in layout_map`: `LayoutMap` answers every lookup.
    keys = list(layout_map)
    if path in keys:
        return path
    matches = [key for key in keys if re.fullmatch(key, path)]
    return matches[0] if len(matches) == 1 else None


def unmatched_rules(layout_map, paths):
    """The variable rules of `layout_map` that match none of `paths`.

    Args:
        layout_map: a `keras.distribution.LayoutMap`.
        paths: variable paths.

    Returns:
        The keys, in the map's order; rules for layer outputs (keys ending
        in `"/output"`) are not variable rules.
    """
    return [
        key
        for key in layout_map
        if not key.endswith(OUTPUT_SUFFIX)
        and not any(key == path or re.fullmatch(key, path) for path in paths)
    ]


def check_model(model, distribution):
    """Warns about the layout rules that match no variable of `model`.

    Once per model and distribution; only for a `keras.Model` under a
    distribution with a `LayoutMap`.

    Args:
        model: the layer just called.
        distribution: the distribution in effect.
    """
    from keras.src.models.model import Model

    layout_map = layout_map_of(distribution)
    if not layout_map or not isinstance(model, Model):
        return
    checked = _checked_models.setdefault(distribution, weakref.WeakSet())
    if model in checked:
        return
    checked.add(model)
    paths = [variable.path for variable in model.variables]
    unmatched = unmatched_rules(layout_map, paths)
    if unmatched:
        warnings.warn(_unmatched_message(model, unmatched, paths), stacklevel=2)


def _unmatched_message(model, unmatched, paths):
    return (
        f"{len(unmatched)} LayoutMap rule(s) of the ModelParallel "
        f"distribution match no variable of model '{model.name}': "
        f"{unmatched}. The variables they were meant for are replicated: "
        "each process holds a full copy. Rules are matched against "
        f"variable paths (`re.fullmatch`), such as "
        f"{paths[:NUM_EXAMPLE_PATHS]}; "
        "`keras.distribution.sharding_summary(model)` lists every variable "
        "and the rule that lays it out."
    )
