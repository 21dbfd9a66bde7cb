"""Which `LayoutMap` rule lays out each variable, and a warning (at a model's
first call) of rules matching no path, which leave variables replicated."""

import re
import warnings
import weakref

_checked_models = weakref.WeakKeyDictionary()


def layout_map_of(distribution):
    """The `LayoutMap` of a `ModelParallel` distribution, else `None`."""
    # `ModelParallel` keeps its map private; it has no public accessor.
    return getattr(distribution, "_layout_map", None)


def matching_rule(layout_map, path):
    """The key laying out `path`: itself, else its one regex match, or None."""
    keys = list(layout_map or ())  # `path in layout_map` is always true.
    if path in keys:
        return path
    matches = [key for key in keys if re.fullmatch(key, path)]
    return matches[0] if len(matches) == 1 else None


def unmatched_rules(layout_map, paths):
    """The keys of `layout_map` matching no `paths`, but those of layer outputs
    (`<layer path>/output`), which lay out no variable."""
    return [
        key
        for key in layout_map
        if not key.endswith("/output")
        and not any(key == path or re.fullmatch(key, path) for path in paths)
    ]


def check_model(model, distribution):
    """Warns once per model and distribution of rules matching no variable."""
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
        warnings.warn(
            f"{len(unmatched)} LayoutMap rule(s) of the ModelParallel "
            f"distribution match no variable of model '{model.name}': "
            f"{unmatched}. The variables they were meant for are replicated: "
            "each process holds a full copy. Rules are matched against "
            f"variable paths (`re.fullmatch`), such as {paths[:5]}; "
            "`keras.distribution.sharding_summary(model)` lists every "
            "variable and the rule that lays it out.",
            stacklevel=2,
        )
