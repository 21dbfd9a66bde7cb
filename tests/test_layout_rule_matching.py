"""Which `LayoutMap` rule lays out a variable path, in one process.

`layout_rules` alone: a path matches its own key first, else the one key
that matches it as a regular expression; rules for layer outputs
(`".../output"`) lay out no variable. The warning a model gets for rules
that match none of its variables: `tests/test_layout_rules.py`.
"""

import keras
from keras.src.backend.torch.distributed.core import layout_rules


def _layout_map():
    mesh = keras.distribution.DeviceMesh((1,), ["model"], devices=["cpu:0"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["seq/dense/kernel"] = (None, "model")
    layout_map[".*dense.*bias"] = ("model",)
    layout_map[".*embedding.*"] = (None, "model")
    layout_map["seq/dense/output"] = (None, "model")
    return layout_map


def test_an_exact_key_comes_before_patterns():
    layout_map = _layout_map()
    assert layout_rules.matching_rule(layout_map, "seq/dense/kernel") == (
        "seq/dense/kernel"
    )
    assert layout_rules.matching_rule(layout_map, "seq/dense/bias") == (
        ".*dense.*bias"
    )
    assert layout_rules.matching_rule(layout_map, "seq/conv/kernel") is None


def test_unmatched_rules_skip_output_rules():
    layout_map = _layout_map()
    paths = ["seq/dense/kernel", "seq/dense/bias"]
    assert layout_rules.unmatched_rules(layout_map, paths) == [".*embedding.*"]
    assert layout_rules.unmatched_rules(layout_map, paths + ["seq/emb"]) == [
        ".*embedding.*"
    ]
    assert layout_rules.unmatched_rules(
        layout_map, ["m/embedding/embeddings"]
    ) == ["seq/dense/kernel", ".*dense.*bias"]


def test_only_model_parallel_has_a_layout_map():
    layout_map = _layout_map()
    mesh = layout_map.device_mesh
    model_parallel = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name=None
    )
    data_parallel = keras.distribution.DataParallel(device_mesh=mesh)
    assert layout_rules.layout_map_of(model_parallel) is layout_map
    assert layout_rules.layout_map_of(data_parallel) is None
