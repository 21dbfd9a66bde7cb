"""`jit_compile=True` under a distribution: the step is compiled, and gives
what one eager process gives.

Each case fits a tiny model with `jit_compile=True` on 2 gloo ranks and
checks that no step fell back to eager (no `jit_compile` warning), that
dynamo compiled graphs during the fit (its compile counter grew), and that
losses, metrics, final weights and optimizer state equal those of the same
model fit eagerly in one process (rtol 1e-4). The compiled fits train a
transformer block (`parity_models`' attention model: an `Embedding` table
sharded on its features under ModelParallel, Keras' `MultiHeadAttention`,
heads sharded, and a feed-forward MLP whose hidden layer splits evenly
over 2 ranks). DTensor compiles a different graph on each rank (it cuts a
replicated tensor to the rank's shard), so one case fits twice: the
second fit compiles from the on-disk cache that both ranks wrote, as a
second run on the same machine does, and must still run each rank's own
graph (`compiled_step.compile_step` keys its cache by rank). A model with
an unevenly sharded variable runs eagerly, after one warning.
(A batch that splits unevenly runs eagerly too; a compiled fit ending on
one costs a second compilation, over a minute on CI's 2 cores, so these
fits use whole batches.)
"""

import warnings

import pytest

from tests import distributions
from tests import parity_models as pm
from tests.harness import run_on_ranks

# Samples per setting: whole batches of 8.
NUM_SAMPLES = {"dp": 16, "mp": 16}
# The model each setting's compiled fit trains.
COMPILED_KIND = {"dp": "batchnorm", "mp": "attention"}


def _fit(kind, setting, num_samples, jit_compile):
    """Fits model `kind`; the result, `jit_compile` warnings, graphs."""
    from torch._dynamo.utils import counters

    distributions.use_setting(setting, layout_rules=pm.LAYOUT_RULES[kind])
    model = pm.build_model(kind, jit_compile=jit_compile)
    x, y = pm.make_data(kind, num_samples=num_samples)
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


def _check(kind, setting, per_rank, fit=""):
    """Checks per-rank fit results against one process."""
    reference = pm.run_single(_fit, kind, "single", NUM_SAMPLES[setting], False)
    for result in per_rank:
        pm.assert_close(result["history"], reference["history"], fit)
        pm.assert_close(result["state"], reference["state"], fit)
        assert result["value_types"] == ["float"]
    pm.assert_ranks_agree([r["state"] for r in per_rank])


@pytest.mark.parametrize("setting", ["dp", "mp"])
def test_compiled_fit_parity(setting):
    """A model compiled on every rank (no fallback), and equal to one
    process: under DataParallel, batch normalization's moments over the
    global batch; under ModelParallel, a transformer block."""
    kind = COMPILED_KIND[setting]
    per_rank = run_on_ranks(
        _fit_body,
        world_size=2,
        args=(kind, setting, NUM_SAMPLES[setting], True),
        timeout=400,
    )
    _check(kind, setting, per_rank)
    for result in per_rank:
        assert result["jit_warnings"] == []
        assert result["graphs"] > 0


def _fit_twice_body(rank, world_size, kind, setting):
    """Two compiled fits; the second compiles from the on-disk cache (the
    ranks share it) that the first wrote or found."""
    import torch
    from torch._dynamo.utils import counters

    import keras

    results = []
    for _ in range(2):
        # Both ranks' cache entries are written before either loads one.
        torch.distributed.barrier()
        keras.backend.clear_session()
        torch._dynamo.reset()
        hits = counters["aot_autograd"]["autograd_cache_hit"]
        result = _fit(kind, setting, NUM_SAMPLES[setting], True)
        hits = counters["aot_autograd"]["autograd_cache_hit"] - hits
        result["cache_hits"] = hits
        results.append(result)
    return results


def test_compiled_fit_from_compile_cache():
    """A sharded embedding table, then a Dense layer whose replicated
    kernel each rank cuts to its own rows: compiled again from the cache
    both ranks wrote, each rank runs its own graph, equal to one process."""
    per_rank = run_on_ranks(
        _fit_twice_body,
        world_size=2,
        args=("embedding", "mp"),
        timeout=400,
    )
    for fit, fits in zip(("first", "second"), zip(*per_rank)):
        _check("embedding", "mp", fits, f"{fit} fit")
    for first, second in per_rank:
        for result in (first, second):
            assert result["jit_warnings"] == []
            assert result["graphs"] > 0
        assert second["cache_hits"] > 0


def test_uneven_variable_shards_run_eagerly():
    """A 31-unit layer on 2 ranks: one warning, eager steps, parity."""
    per_rank = run_on_ranks(
        _fit_body,
        world_size=2,
        args=("mlp", "mp", NUM_SAMPLES["mp"], True),
        timeout=400,
    )
    _check("mlp", "mp", per_rank)
    for result in per_rank:
        assert len(result["jit_warnings"]) == 1, result["jit_warnings"]
        assert "sharded unevenly" in result["jit_warnings"][0]
        assert result["graphs"] == 0


def test_a_first_compiled_step_out_of_memory_is_raised_not_run_eagerly():
    """An out-of-memory error is no reason to compile less: the eager step
    needs no less memory, so it is raised, not retried eagerly; another
    error of the compiled call is."""
    import torch

    import keras
    from keras.src.backend.torch.distributed.training import compiled_step

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])

    def failing(error):
        def step(data):
            raise error

        return step

    oom = torch.cuda.OutOfMemoryError("CUDA out of memory.")
    with pytest.raises(torch.cuda.OutOfMemoryError):
        compiled_step.run_first(failing(oom), model, None)
    cpu_oom = RuntimeError("DefaultCPUAllocator: can't allocate memory: 1 GB")
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator"):
        compiled_step.run_first(failing(cpu_oom), model, None)
    with pytest.warns(UserWarning, match="Running the step eagerly"):
        with pytest.raises(compiled_step.CompileFailed):
            compiled_step.run_first(failing(TypeError("x")), model, None)


def _failing_first_call_body(rank, world_size, failing_ranks, after):
    """Fits with compiled steps standing for the eager ones (no compiling
    time), whose first call fails on `failing_ranks` (`after` its
    collectives: the others wait for none of its)."""
    import functools

    from keras.src.backend.torch.distributed.training import compiled_step

    compiled_step.compile_step = functools.partial
    run = compiled_step.run
    calls = []

    def failing_run(step_function, model, data):
        calls.append(None)
        if len(calls) > 1 or rank not in failing_ranks:
            return run(step_function, model, data)
        if after:
            run(step_function, model, data)
        raise TypeError("this process cannot compile the step")

    compiled_step.run = failing_run
    try:
        return _fit("mlp", "dp", NUM_SAMPLES["dp"], True)
    except RuntimeError as error:
        return {"error": str(error)}


def test_a_first_compiled_step_failing_on_some_processes_stops_all():
    per_rank = run_on_ranks(
        _failing_first_call_body, world_size=2, args=([1], True), timeout=120
    )
    for result in per_rank:
        assert "error" in result, result
        assert "failed on process 1" in result["error"], result["error"]
        assert "cannot compile the step" in result["error"], result["error"]


def test_a_first_compiled_step_failing_on_every_process_runs_eagerly():
    per_rank = run_on_ranks(
        _failing_first_call_body,
        world_size=2,
        args=([0, 1], False),
        timeout=120,
    )
    assert all("error" not in result for result in per_rank), per_rank
    _check("mlp", "dp", per_rank)
    for result in per_rank:
        assert len(result["jit_warnings"]) == 1, result["jit_warnings"]
        assert "cannot compile the step" in result["jit_warnings"][0]
