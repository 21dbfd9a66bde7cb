"""`jit_compile=True` under a distribution: the step is compiled, and gives
what one eager process gives.

Each case fits a tiny model with `jit_compile=True` on 2 gloo ranks and
checks that no step fell back to eager (no `jit_compile` warning), that
dynamo compiled graphs during the fit (its compile counter grew), and that
losses, metrics, final weights and optimizer state equal those of the same
model fit eagerly in one process (rtol 1e-4), on an MLP whose hidden layer
splits evenly over 2 ranks. (Models with Keras' `MultiHeadAttention` do not
compile yet: see benchmarks/README.md; they fall back to eager with a
warning, as before.) A model with an unevenly sharded variable runs
eagerly, after one warning. (A batch that splits unevenly runs eagerly
too; a compiled fit ending on one costs a second compilation, over a
minute on CI's 2 cores, so these fits use whole batches.)
"""

import warnings

import pytest

from tests import distributions
from tests import parity_models as pm
from tests.harness import run_on_ranks

# Samples per setting: whole batches of 8.
NUM_SAMPLES = {"dp": 16, "mp": 16}


def _even_mlp():
    """`parity_models`' MLP with 32 hidden units: even shards on 2 ranks."""
    import keras
    from keras import layers

    inputs = layers.Input((5,))
    hidden = layers.Dense(32, activation="relu", name="hidden")(inputs)
    outputs = layers.Dense(3, name="out")(hidden)
    return keras.Model(inputs, outputs, name="mlp")


def _build(kind, jit_compile):
    import keras

    keras.utils.set_random_seed(pm.SEED)
    model = _even_mlp() if kind == "even_mlp" else pm.build_model(kind)
    pm.compile_for(model, "mlp", jit_compile=jit_compile)
    return model


def _fit(kind, setting, num_samples, jit_compile):
    """Fits model `kind`; the result, `jit_compile` warnings, graphs."""
    from torch._dynamo.utils import counters

    distributions.use_setting(setting, layout_rules=pm.LAYOUT_RULES["mlp"])
    model = _build(kind, jit_compile)
    x, y = pm.make_data("mlp", num_samples=num_samples)
    graphs = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            x, y, batch_size=8, epochs=2, shuffle=False, verbose=0
        )
    result = pm.fit_result(model, history)
    result["jit_warnings"] = [
        str(w.message) for w in caught if "jit_compile" in str(w.message)
    ]
    result["graphs"] = counters["stats"]["unique_graphs"] - graphs
    return result


def _fit_body(rank, world_size, *args):
    return _fit(*args)


def _check(kind, setting):
    """Per-rank results of the compiled fit, checked against one process."""
    num_samples = NUM_SAMPLES[setting]
    per_rank = run_on_ranks(
        _fit_body,
        world_size=2,
        args=(kind, setting, num_samples, True),
        timeout=400,
    )
    reference = pm.run_single(_fit, kind, "single", num_samples, False)
    for result in per_rank:
        pm.assert_close(result["history"], reference["history"], "history")
        pm.assert_close(result["state"], reference["state"], "state")
        assert result["value_types"] == ["float"]
    pm.assert_ranks_agree([r["state"] for r in per_rank])
    return per_rank


@pytest.mark.parametrize("setting", ["dp", "mp"])
def test_compiled_fit_parity(setting):
    """Compiled on every rank (no fallback), and equal to one process."""
    for result in _check("even_mlp", setting):
        assert result["jit_warnings"] == []
        assert result["graphs"] > 0


def test_uneven_variable_shards_run_eagerly():
    """A 31-unit layer on 2 ranks: one warning, eager steps, parity."""
    for result in _check("mlp", "mp"):
        assert len(result["jit_warnings"]) == 1, result["jit_warnings"]
        assert "sharded unevenly" in result["jit_warnings"][0]
        assert result["graphs"] == 0
