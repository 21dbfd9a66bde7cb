"""The training step as one object (`distributed.step.DistributedStep`).

The trainer builds one `DistributedStep` per step function; it decides
the step's path (local rows or DTensor), its reductions and its loss for
its model, keeps what a step needs on itself, and is set on the model
while it runs, where the train step's hooks find it. No step state lives
in module globals. The tests reach a model's step through
`step.model_step` on both bases: on Keras 3.15.1 it is the step function
(`model.train_function`); Keras master's trainer calls it on each batch
from inside its own step function.
"""

import ast
import inspect

import numpy as np

from tests import distributions
from tests.harness import run_on_ranks

# The modules a step runs through, and the module-level state they may
# keep, with why (each is also said in a comment where it is defined).
STEP_MODULES = (
    "training.step",
    "training.compiled_step",
    "training.step_reduction",
    "data_parallel.local_rows",
    "data_parallel.coupled_layers",
    "data_parallel.local_loss",
    "core.local_state",
    "training.layer_call",
    "fsdp.fsdp",
    "fsdp.fsdp_call",
    "fsdp.fsdp_schedule",
)
ALLOWED_MODULE_STATE = {
    # Mirror torch's process-wide `implicit_replication` flag: the open
    # contexts, whether the process has a distribution, the flag's context.
    ("layer_call", "_replication_depth"),
    ("layer_call", "_replication_held"),
    ("layer_call", "_implicit_replication"),
    # Mirror torch's process-wide SDPA flags: the backends enabled outside
    # the step's math SDPA on a CPU mesh, the open local-rows calls that
    # take them back, and whether a step on plain rows left math SDPA to
    # the calls on DTensors within it.
    ("layer_call", "_outer_sdpa_backends"),
    ("layer_call", "_plain_kernels_depth"),
    ("layer_call", "_math_within"),
    # Per thread: the depth of the layer calls a thread makes.
    ("layer_call", "_calls"),
    # Per layer, weakly: the probe's verdicts on calls outside a step (a
    # step keeps its own).
    ("local_rows", "_verdicts"),
    # Per thread: the coupled layers of the local call running now.
    ("coupled_layers", "_state"),
    # Per thread: the layer calls whose gathered values stand for their
    # variables now, and those variables (a layer called inside its own
    # call, or inside the call that gathered them, keeps them).
    ("fsdp_call", "_thread_state"),
    # Per thread: the gather schedule of the step running in this thread
    # (the schedule itself is the step's).
    ("fsdp_schedule", "_running"),
    # Per step function, weakly: its gather schedule, kept across its steps.
    ("fsdp_schedule", "_schedules"),
    # Per replicated `DTensor`, weakly: its local tensor, which never
    # changes (the state a step reads locally).
    ("local_state", "_REPLICATED_LOCALS"),
}
_MUTABLE_CALLS = {
    "dict",
    "list",
    "set",
    "WeakSet",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "local",
    "defaultdict",
}


def _module_state(name):
    """Names of a module's mutable module-level state: globals assigned in
    functions (`global x`) and module-level mutable containers."""
    import importlib

    module = importlib.import_module(
        f"keras.src.backend.torch.distributed.{name}"
    )
    tree = ast.parse(inspect.getsource(module))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.update(node.names)
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)):
            continue
        value = node.value
        mutable = isinstance(
            value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp)
        )
        if isinstance(value, ast.Call):
            func = value.func
            called = getattr(func, "attr", getattr(func, "id", None))
            mutable = called in _MUTABLE_CALLS
        if mutable:
            targets = (
                node.targets if isinstance(node, ast.Assign) else [node.target]
            )
            found.update(t.id for t in targets if isinstance(t, ast.Name))
    return {(name.rpartition(".")[2], x) for x in found}


def test_no_step_state_in_module_globals():
    import keras  # noqa: F401

    state = set()
    for name in STEP_MODULES:
        state |= _module_state(name)
    assert state == ALLOWED_MODULE_STATE


def _model(kind):
    import keras

    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, activation="relu", name="fc1")(inputs)
    if kind == "dropout":
        x = keras.layers.Dropout(0.5, seed=1)(x)
    if kind == "lambda":
        x = keras.layers.Lambda(lambda t: t * 2.0)(x)
    outputs = keras.layers.Dense(2, name="fc2")(x)
    if kind == "custom_step":

        class CustomStep(keras.Model):
            def train_step(self, data):
                return super().train_step(data)

        model = CustomStep(inputs, outputs)
    else:
        model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    return model


def _decisions_body(rank, world_size, setting, kind):
    import keras
    from keras.src.backend.torch import distribution_lib
    from keras.src.backend.torch.distributed.training.step import (
        DistributedStep,
    )
    from keras.src.backend.torch.distributed.training.step import model_step
    from keras.src.backend.torch.distributed.training.step import running_step

    distributions.use_setting(
        setting, layout_rules={"fc1/kernel": (None, "model")}
    )
    model = _model(kind)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6)).astype("float32")
    y = rng.normal(size=(8, 2)).astype("float32")
    seen = {}
    local_loss = distribution_lib.local_loss

    def watching_local_loss(model, *args):
        # The train step's hook finds the step on the model it has.
        running = running_step(model)
        seen["running"] = running is model_step(model, "train")
        return local_loss(model, *args)

    distribution_lib.local_loss = watching_local_loss
    try:
        model.train_on_batch(x, y)
    finally:
        distribution_lib.local_loss = local_loss
    model.train_on_batch(x, y)
    model.evaluate(x, y, batch_size=8, verbose=0)
    train, test = model_step(model, "train"), model_step(model, "test")
    mesh = keras.distribution.distribution().device_mesh.backend_mesh
    result = {
        "objects": [isinstance(f, DistributedStep) for f in (train, test)],
        "running": seen["running"],
        "after": running_step(model) is None,
        "overlaps": [train._overlaps_reduction, test._overlaps_reduction],
        "local": [f.rows.may_run_locally(mesh) for f in (train, test)],
        "draws": [
            train.rows.runs_through_dtensor,
            test.rows.runs_through_dtensor,
        ],
        "leaves": len(train._leaves),
        "loss": float(model.evaluate(x, y, batch_size=8, verbose=0)),
    }
    keras.distribution.set_distribution(None)
    return result


def _decisions(setting, kind):
    per_rank = run_on_ranks(_decisions_body, world_size=2, args=(setting, kind))
    assert per_rank[0]["loss"] == per_rank[1]["loss"]
    return per_rank[0]


def test_data_parallel_per_sample_model_runs_on_local_rows():
    # Keras' own train step, Keras' own layers: the local rows, the
    # weights as plain leaves, buckets reduced while backward runs.
    d = _decisions("dp", "mlp")
    assert d["objects"] == [True, True]
    assert d["running"] and d["after"]
    assert d["overlaps"] == [True, False]
    assert d["local"] == [True, True]
    assert d["draws"] == [False, False]
    assert d["leaves"] == 4


def test_a_step_that_draws_random_numbers_runs_on_local_rows():
    # The train step's dropout mask is drawn by position: each process
    # draws its own rows of the global batch's mask, so the probe finds the
    # call per-sample and both step functions stay on the local rows (the
    # second train step with the weights as leaves).
    d = _decisions("dp", "dropout")
    assert d["draws"] == [False, False]
    assert d["local"] == [True, True]
    assert d["leaves"] == 4


def test_custom_train_step_and_user_code_decide_otherwise():
    d = _decisions("dp", "custom_step")
    assert d["overlaps"] == [False, False]
    assert d["leaves"] == 0
    # A `Lambda` of elementwise ops is per-sample (the probe decides, not
    # the layer's class): the local rows, with the weights as leaves.
    d = _decisions("dp", "lambda")
    assert d["local"] == [True, True]
    assert d["leaves"] == 4


def test_model_parallel_runs_through_dtensor():
    d = _decisions("mp", "mlp")
    assert d["objects"] == [True, True]
    assert d["local"] == [False, False]
    assert d["leaves"] == 0


def test_without_a_distribution_the_step_calls_the_function():
    import keras
    from keras.src.backend.torch.distributed.training.step import model_step
    from keras.src.backend.torch.distributed.training.step import running_step

    keras.distribution.set_distribution(None)
    model = _model("mlp")
    x = np.zeros((4, 6), "float32")
    y = np.zeros((4, 2), "float32")
    model.train_on_batch(x, y)
    assert running_step(model) is None
    assert model_step(model, "train")._leaves == {}


def _lazy_model_steps(setting):
    """Train steps of a `Sequential` built by its first step, a weight made
    untrainable after two; the losses, and what the step decided when.

    Counts the probes of the model's calls (`local_rows._probe`), the
    bucketings of its weights (`step_reduction._reverse_buckets`) and the
    calls on the local rows, after the first step and after the others.
    """
    import keras
    from keras.src.backend.torch.distributed.data_parallel import local_rows
    from keras.src.backend.torch.distributed.training import step_reduction

    distributions.use_setting(setting)
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.layers.Dense(8, activation="relu", name="fc1"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(2, name="fc2"),
        ]
    )
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6)).astype("float32")
    y = rng.normal(size=(8, 2)).astype("float32")
    counts = {"probes": 0, "bucketings": 0, "local": 0}
    probe = local_rows._probe
    reverse_buckets = step_reduction._reverse_buckets
    call = local_rows._call_locally

    def counting(name, function):
        def counted(*args, **kwargs):
            result = function(*args, **kwargs)
            counts[name] += 1 if name != "local" else result is not None
            return result

        return counted

    local_rows._probe = counting("probes", probe)
    step_reduction._reverse_buckets = counting("bucketings", reverse_buckets)
    local_rows._call_locally = counting("local", call)
    losses, snapshots = [], []
    try:
        for i in range(5):
            if i == 3:
                # Other trainable weights: other buckets.
                model.get_layer("fc1").trainable = False
            losses.append(float(model.train_on_batch(x, y)))
            snapshots.append(dict(counts))
    finally:
        local_rows._probe = probe
        step_reduction._reverse_buckets = reverse_buckets
        local_rows._call_locally = call
        keras.distribution.set_distribution(None)
    return {"losses": losses, "counts": snapshots}


def _lazy_model_body(rank, world_size):
    return _lazy_model_steps("dp")


def test_the_step_classifies_and_buckets_its_model_once():
    """Decided once the model is built, not in every step; decided anew
    for other trainable weights; one process' losses throughout."""
    from tests import parity_models as pm

    per_rank = run_on_ranks(_lazy_model_body, world_size=2)
    reference = pm.run_single(_lazy_model_steps, "single")
    for result in per_rank:
        np.testing.assert_allclose(
            result["losses"], reference["losses"], rtol=1e-5
        )
        first, third, fourth, last = [result["counts"][i] for i in (0, 2, 3, 4)]
        # Built by the first step, whose call is the probe's; every later
        # step ran on the local rows.
        assert [c["local"] for c in result["counts"]] == [0, 1, 2, 3, 4]
        assert first["probes"] == last["probes"] == 1
        # Bucketed once for the first three steps, once more when fc1's
        # weights stopped training, then kept.
        assert first["bucketings"] == third["bucketings"] == 1
        assert fourth["bucketings"] == last["bucketings"] == 2
