"""The plan of `AutoModelParallel` (`keras/src/distribution/auto_plan.py`).

In one process: a recording distribution asks the planner for each variable
as it is created and keeps its answer (the variable itself stays plain,
`tests/auto_plan_recorder.py`).
The multi-process runs, numbers equal to one process, are the keras-hub
catalogue's `auto_*` modes (`tests/test_keras_hub_catalogue.py`) and
`tests/test_auto_parallel.py`.
"""

import numpy as np
import pytest

import keras
from keras.src.distribution import auto_plan
from tests.auto_plan_recorder import record_plan
from tests.harness import run_on_ranks


def _plan(build, mesh_shape=None):
    return record_plan(build, mesh_shape)


def _mlp():
    inputs = keras.Input((8,))
    x = keras.layers.Dense(32, activation="gelu", name="up")(inputs)
    x = keras.layers.Dense(8, name="down")(x)
    return keras.Model(inputs, keras.layers.LayerNormalization(name="norm")(x))


def test_dense_pair_is_column_then_row():
    axes = _plan(_mlp).axes
    assert axes["up/kernel"] == (None, "model")
    assert axes["up/bias"] == ("model",)
    assert axes["down/kernel"] == ("model", None)
    # A row-parallel layer's bias and norms stay replicated.
    assert axes["down/bias"] == (None,)
    assert axes["norm/gamma"] == (None,)


def test_sequential_and_subclassed_models_pair_alike():
    def sequential():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(8),
            ]
        )
        return model

    class Block(keras.Model):
        def __init__(self):
            super().__init__()
            self.up = keras.layers.Dense(32, activation="relu")
            self.down = keras.layers.Dense(8)

        def call(self, x):
            return self.down(self.up(x))

    for build in (sequential, lambda: Block()(np.zeros((2, 8)))):
        kernels = [a for p, a in _plan(build).axes.items() if "kernel" in p]
        assert kernels == [(None, "model"), ("model", None)], kernels


def test_gated_mlp_has_two_columns_and_one_row():
    class Gated(keras.layers.Layer):
        def build(self, shape):
            self.gate = keras.layers.Dense(32, use_bias=False, name="gate")
            self.gate.build(shape)
            self.up_proj = keras.layers.Dense(32, use_bias=False, name="up")
            self.up_proj.build(shape)
            self.out = keras.layers.Dense(8, use_bias=False, name="out")
            self.out.build((None, 32))

        def call(self, x):
            return self.out(keras.ops.silu(self.gate(x)) * self.up_proj(x))

    axes = _plan(lambda: Gated()(np.zeros((2, 8)))).axes
    kernels = {p.split("/")[-2]: a for p, a in axes.items()}
    assert kernels == {
        "gate": (None, "model"),
        "up": (None, "model"),
        "out": ("model", None),
    }


def test_multi_head_attention_shards_heads():
    def build():
        layer = keras.layers.MultiHeadAttention(4, 8, name="mha")
        x = np.zeros((2, 3, 16), "float32")
        layer(x, x)

    recorder = _plan(build)
    axes = recorder.axes
    # Query (16, heads, 8): heads; output (heads, 8, 16): heads, row.
    assert axes["mha/query/kernel"] == (None, "model", None)
    assert axes["mha/query/bias"] == ("model", None)
    assert axes["mha/attention_output/kernel"] == ("model", None, None)
    assert axes["mha/attention_output/bias"] == (None,)
    assert "column-parallel over heads" in recorder.reasons["mha/key/kernel"]
    assert (
        "row-parallel over heads"
        in recorder.reasons["mha/attention_output/kernel"]
    )


def test_indivisible_heads_split_the_input_features():
    def build():
        # One head: indivisible by a model axis of 2. Its head size is not
        # split (that would split each attention score into partial sums);
        # its input features are, as a row-parallel layer's.
        layer = keras.layers.EinsumDense(
            "btd,kdh->btkh", output_shape=(None, 1, 8), name="key"
        )
        layer.build((None, None, 16))

    recorder = _plan(build)
    assert recorder.axes["key/kernel"] == (None, "model", None)
    assert "heads indivisible" in recorder.reasons["key/kernel"]


class _GroupedQueryAttention(keras.layers.Layer):
    def build(self, shape):
        # Two query heads, one key/value head (Gemma's).
        self.query = keras.layers.EinsumDense(
            "btd,ndh->btnh", output_shape=(None, 2, 8), name="query"
        )
        self.query.build(shape)
        self.key = keras.layers.EinsumDense(
            "bsd,kdh->bskh", output_shape=(None, 1, 8), name="key"
        )
        self.key.build(shape)
        self.value = keras.layers.EinsumDense(
            "bsd,kdh->bskh", output_shape=(None, 1, 8), name="value"
        )
        self.value.build(shape)
        self.out = keras.layers.EinsumDense(
            "btnh,nhd->btd", output_shape=(None, 16), name="out"
        )
        self.out.build((None, None, 2, 8))

    def call(self, x):
        return x


def _grouped_query_plan(vocabulary_size=None, mesh=None):
    def build():
        if vocabulary_size:
            keras.layers.Embedding(vocabulary_size, 16).build((None,))
        _GroupedQueryAttention()(np.zeros((2, 3, 16), "float32"))

    recorder = _plan(build, mesh)
    axes = {
        p.split("/")[-2]: a
        for p, a in recorder.axes.items()
        if "embedding" not in p
    }
    reasons = {p.split("/")[-2]: r for p, r in recorder.reasons.items()}
    gathered = {p.split("/")[-2] for p in recorder.gathered}
    return axes, reasons, gathered


def test_too_few_key_value_heads_beside_sharded_queries_are_gathered():
    # Alone, the key/value heads are too large a part of the model to
    # replicate within the budget: stored sharded (each at 1/2), they are
    # gathered for each call of the block, where the query heads split.
    axes, reasons, gathered = _grouped_query_plan()
    assert axes["query"] == ("model", None, None)
    assert axes["key"] == (None, "model", None)
    assert axes["value"] == (None, "model", None)
    assert axes["out"] == ("model", None, None)
    assert gathered == {"key", "value"}
    assert "gathered for each call" in reasons["key"]


def test_a_block_whose_query_heads_are_indivisible_is_gathered_whole():
    # Two query heads on four processes: no projection of the block can
    # split its heads, and every kernel of it is gathered for each call,
    # stored sharded on a dimension the model axis divides.
    axes, reasons, gathered = _grouped_query_plan(mesh={"batch": 1, "model": 4})
    assert gathered == {"query", "key", "value", "out"}
    assert all("model" in a for a in axes.values())
    # A mesh with a batch axis gathers kernels along it for each call
    # already: a second gather per call, along the model axis, would
    # cost more than splitting input features (row parallel).
    axes, reasons, gathered = _grouped_query_plan(mesh={"batch": 2, "model": 4})
    assert not gathered
    assert "row-parallel over input features" in reasons["query"]


def test_key_value_heads_beside_sharded_queries_replicate_within_budget():
    # After a preset-sized embedding (16384 elements), the key/value
    # kernels (128 each, 64 beyond an even share) fit the budget: they are
    # replicated, as Megatron-LM's, and cost no collective.
    axes, reasons, gathered = _grouped_query_plan(vocabulary_size=1024)
    assert not gathered
    assert axes["query"] == ("model", None, None)
    assert axes["key"] == (None, None, None)
    assert axes["value"] == (None, None, None)
    assert axes["out"] == ("model", None, None)
    assert "beside sharded query heads" in reasons["key"]
    # A budget of nothing splits their features again.
    budget = auto_plan.REPLICATION_BUDGET
    auto_plan.REPLICATION_BUDGET = 0.0
    try:
        axes, _, gathered = _grouped_query_plan(vocabulary_size=1024)
    finally:
        auto_plan.REPLICATION_BUDGET = budget
    assert axes["key"] == (None, "model", None)
    assert gathered == {"key", "value"}


def _narrow_blocks():
    # Narrow blocks: their row biases and norms are a twelfth of the model,
    # as the vectors of a tiny config are.
    inputs = keras.Input((8,))
    x = inputs
    for i in range(4):
        x = keras.layers.Dense(16, activation="gelu", name=f"up{i}")(x)
        x = keras.layers.Dense(8, name=f"down{i}")(x)
        x = keras.layers.LayerNormalization(name=f"norm{i}")(x)
    return keras.Model(inputs, x)


def test_replicated_weights_past_the_share_bound_are_sharded():
    bound = 1 / 4 + auto_plan.SHARE_BOUND
    built = {}
    recorder = _plan(
        lambda: built.setdefault("model", _narrow_blocks()),
        {"batch": 1, "model": 4},
    )
    weights = built["model"].weights
    assert recorder.share(weights) <= bound + 1e-9
    # Replicated while the running excess fits the bound (the first row
    # bias), sharded over the model axis once it would not.
    assert recorder.axes["down0/bias"] == (None,)
    past = [p for p, r in recorder.reasons.items() if "past" in r]
    assert past and all(recorder.axes[p] == ("model",) for p in past)
    # Without the bound, every process would store more than it allows.
    saved = auto_plan.SHARE_BOUND
    auto_plan.SHARE_BOUND = 1.0
    try:
        recorder = _plan(
            lambda: built.update(model=_narrow_blocks()),
            {"batch": 1, "model": 4},
        )
    finally:
        auto_plan.SHARE_BOUND = saved
    assert recorder.share(built["model"].weights) > bound


def test_embedding_shards_vocabulary_and_2d_mesh_adds_batch_axis():
    def build():
        keras.layers.Embedding(48, 16, name="embed").build((None,))
        _mlp()

    axes = _plan(build, {"batch": 2, "model": 2}).axes
    assert axes["embed/embeddings"] == ("model", "batch")
    # The largest other dimension goes over the batch axis (FSDP-like).
    assert axes["up/kernel"] == ("batch", "model")
    assert axes["down/kernel"] == ("model", "batch")
    assert axes["up/bias"] == ("model",)


def test_a_blocks_vectors_join_its_gather_over_the_batch_axis():
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.norm = keras.layers.LayerNormalization(name="norm")
            self.up = keras.layers.Dense(128, name="up")
            self.down = keras.layers.Dense(8, name="down")

        def call(self, x):
            return self.down(self.up(self.norm(x)))

    # Wide enough that what stays replicated is within `SHARE_BOUND`.
    def build():
        inputs = keras.Input((8,))
        x = Block(name="block")(inputs)
        x = keras.layers.LayerNormalization(name="final_norm")(x)
        # Narrow: its output stays whole over the model axis.
        keras.layers.Dense(4, name="head")(x)

    axes = _plan(build, {"batch": 2, "model": 2}).axes
    # Inside a block, vectors are gathered with the block's kernels: the
    # batch axis shards them at no collective of their own.
    assert axes["block/norm/gamma"] == ("batch",)
    assert axes["block/up/bias"] == ("model",)
    assert axes["block/down/bias"] == ("batch",)
    # A layer of the model itself gathers its own: its vectors stay whole,
    # but beside a kernel sharded over the batch axis.
    assert axes["final_norm/gamma"] == (None,)
    assert axes["head/kernel"] == ("batch", None)
    assert axes["head/bias"] == ("batch",)
    # With no batch axis to share, vectors stay replicated.
    axes = _plan(build, {"batch": 1, "model": 2}).axes
    assert axes["block/norm/gamma"] == (None,)
    assert axes["block/down/bias"] == (None,)


def test_one_axis_mesh_shards_kernels_over_it_once():
    # A 1-D mesh: the batch and the model share the axis "x".
    plan = auto_plan.Plan({"x": 2}, "x", "x")
    axes, _ = plan._mesh.shard((4, 6), [1, 0], lambda d: "column")
    assert axes == (None, "x")


@pytest.mark.parametrize(
    "mesh_shape, batch_dim_name",
    [({"batch": 1, "model": 2}, "batch"), ({"model": 2}, "model")],
)
def test_a_kernel_checked_row_parallel_leaves_its_bias_whole(
    mesh_shape, batch_dim_name
):
    # On a 1-D mesh the batch's axis is the model's: a bias sharded over it
    # as a column's is not sharded over the batch, and is made whole too.
    layers = []

    def build():
        x = keras.Input((16,))
        for i in range(3):
            layers.append(keras.layers.Dense(16, name=f"d{i}"))
            x = layers[-1](x)

    recorder = record_plan(build, mesh_shape, batch_dim_name)
    d1 = layers[1]
    assert recorder.axes["d1/bias"] == ("model",)
    weights = [(w, recorder.axes[w.path]) for w in d1.weights]
    relaid = recorder.plan.check_pairing(d1, auto_plan.ROW, weights)
    assert {v.path: axes for v, axes, _ in relaid} == {
        "d1/kernel": ("model", None),
        "d1/bias": (None,),
    }


def test_nothing_divisible_is_replicated():
    def build():
        keras.layers.Dense(3, name="odd").build((None, 5))

    recorder = _plan(build, {"batch": 1, "model": 4})
    assert recorder.axes["odd/kernel"] == (None, None)
    assert "replicated" in recorder.reasons["odd/kernel"]


def test_auto_model_parallel_arguments():
    kd = keras.distribution
    devices = kd.list_devices()
    distribution = kd.AutoModelParallel()
    assert list(distribution.device_mesh.axis_names) == ["batch", "model"]
    assert distribution.device_mesh.shape == (1, len(devices))
    assert distribution.batch_dim_name == "batch"
    assert distribution.model_dim_name == "model"
    mesh = kd.DeviceMesh((len(devices),), ["x"], devices)
    with pytest.raises(ValueError, match="is not an axis"):
        kd.AutoModelParallel(device_mesh=mesh, model_dim_name="model")
    other = kd.DeviceMesh((1, len(devices)), ["batch", "model"], devices)
    with pytest.raises(ValueError, match="same|built on"):
        kd.AutoModelParallel(device_mesh=mesh, layout_map=kd.LayoutMap(other))
    with pytest.raises(ValueError, match="LayoutMap"):
        kd.AutoModelParallel(layout_map={"a": (None,)})


def _override_body(rank, world_size):
    kd = keras.distribution
    devices = kd.list_devices()
    mesh = kd.DeviceMesh((1, len(devices)), ["batch", "model"], devices)
    layout_map = kd.LayoutMap(mesh)
    layout_map["up/kernel"] = ("model", None)
    distribution = kd.AutoModelParallel(layout_map=layout_map)
    with distribution.scope():
        model = _mlp()
        rows = kd.sharding_summary(model)
    return {
        "reasons": {row["path"]: row["layout_rule"] for row in rows},
        "up": distribution.layout_reason("up/kernel"),
        "down": distribution.layout_reason("down/kernel"),
        "nothing": distribution.layout_reason("nothing"),
    }


def test_layout_map_rules_override_the_plan():
    # On real ranks: sharded variables would start a process group in the
    # test process, which a later test's forked child would inherit.
    result = run_on_ranks(_override_body, world_size=2)[0]
    # The summary says what placed each variable: the rule, or the plan.
    reasons = result["reasons"]
    assert reasons["up/kernel"] == "up/kernel"
    assert reasons["down/kernel"].startswith("auto: ")
    assert result["up"] == "rule: up/kernel"
    assert result["down"].startswith("auto: ")
    assert result["nothing"] is None


def test_a_kernel_widths_cannot_pair_waits_for_its_first_call():
    layers = []

    def build():
        inputs = keras.Input((16,))
        x = inputs
        for i in range(3):
            layers.append(keras.layers.Dense(16, name=f"d{i}"))
            x = layers[-1](x)
        keras.layers.Dense(32, name="wide")(x)

    recorder = _plan(build)
    plan = recorder.plan
    d0, d1, d2 = layers
    # d0 reads the input: nothing else it could read. d1 and d2 read a
    # width d0 both read and left open.
    assert plan.paired_role(d0) is None
    assert plan.paired_role(d1) == auto_plan.COLUMN
    assert plan.paired_role(d2) == auto_plan.COLUMN

    def weights(layer):
        return [(w, recorder.axes[w.path]) for w in layer.weights]

    relaid = plan.check_pairing(d1, auto_plan.ROW, weights(d1))
    assert {v.path: axes for v, axes, _ in relaid} == {
        "d1/kernel": ("model", None),
        "d1/bias": (None,),
    }
    reason = dict((v.path, why) for v, _, why in relaid)["d1/kernel"]
    assert "row-parallel dense (16->16)" in reason
    assert "reads a column-parallel output" in reason
    assert plan.kernel_role(d1) == auto_plan.ROW
    # Checked once: the call's answer stands.
    assert plan.paired_role(d1) is None
    assert plan.check_pairing(d1, auto_plan.COLUMN, weights(d1)) == []
    # A kernel that reads as its widths said moves nothing.
    assert plan.check_pairing(d2, auto_plan.COLUMN, weights(d2)) == []
    assert plan.paired_role(d2) is None
