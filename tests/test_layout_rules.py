"""Layout rules that match no variable are reported, not silently ignored.

A `LayoutMap` rule that matches no variable path leaves the variables it
was meant for replicated on every process. A model called under
`ModelParallel` warns once, naming such rules; `sharding_summary` says which
rule laid out each variable, and marks those no rule matched.
"""

import numpy as np

from tests import distributions
from tests.harness import run_on_ranks

RULES = {
    "dense/kernel": (None, "model"),
    "top/kernel": ("model", None),
    # A typo, and a rule for a layer renamed since: they match nothing.
    "dens/bias": ("model",),
    ".*renamed.*kernel": (None, "model"),
    # Lays out a layer's outputs, not a variable.
    "dense/output": ("batch", None),
}
UNMATCHED = ["dens/bias", ".*renamed.*kernel"]


def _nested_model():
    """`top(inner(x))`: `top` is outside the nested `inner` model."""
    import keras

    keras.utils.set_random_seed(1)
    x = keras.Input((4,))
    hidden = keras.layers.Dense(6, name="dense")(x)
    inner = keras.Model(x, keras.layers.Dense(2, name="head")(hidden))
    y = keras.layers.Dense(3, name="top")(inner(x))
    return keras.Model(x, y, name="outer")


def _unmatched_rules_body(rank, world_size):
    import warnings

    import keras

    distributions.use_model_parallel(
        layout_rules=RULES, mesh_shape=(1, world_size)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _nested_model()
        model(np.ones((2, 4), "float32"))
        model.compile(optimizer="sgd", loss="mse")
        model.fit(np.ones((4, 4)), np.ones((4, 3)), batch_size=4, verbose=0)
        model.predict(np.ones((2, 4)), verbose=0)
        # Another model under the same distribution is checked as well.
        other = keras.Sequential([keras.layers.Dense(2)], name="other")
        other(np.ones((1, 2)))
    printed = []
    rows = keras.distribution.sharding_summary(model, print_fn=printed.append)
    return {
        "warnings": [
            str(w.message) for w in caught if "LayoutMap" in str(w.message)
        ],
        "rules": {row["path"]: row["layout_rule"] for row in rows},
        "lines": printed[0].splitlines(),
    }


def test_unmatched_rules_warn_once_per_model_and_show_in_the_summary():
    results = run_on_ranks(_unmatched_rules_body, world_size=2)
    for result in results:
        outer, other = result["warnings"]
        assert "'outer'" in outer
        assert str(UNMATCHED) in outer
        for matched in ("'dense/kernel'", "'top/kernel'", "'dense/output'"):
            assert matched not in outer.split("[")[1], outer
        assert "dense/kernel" in outer  # The examples of variable paths.
        assert "sharding_summary" in outer
        assert "'other'" in other
        assert "'dense/kernel', 'top/kernel', 'dens/bias'" in other
        assert result["rules"] == {
            "dense/kernel": "dense/kernel",
            "dense/bias": None,
            "head/kernel": None,
            "head/bias": None,
            "top/kernel": "top/kernel",
            "top/bias": None,
        }
        lines = {line.split()[2]: line for line in result["lines"][1:-1]}
        assert lines["dense/kernel"].endswith(" dense/kernel")
        assert lines["dense/bias"].endswith(" (no rule)")
        assert lines["top/kernel"].endswith(" top/kernel")
    assert results[0]["warnings"] == results[1]["warnings"]


def _data_parallel_body(rank, world_size):
    import warnings

    distributions.use_data_parallel()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _nested_model()(np.ones((2, 4), "float32"))
    return [str(w.message) for w in caught if "LayoutMap" in str(w.message)]


def test_no_warning_without_a_layout_map():
    assert run_on_ranks(_data_parallel_body, world_size=2) == [[], []]
