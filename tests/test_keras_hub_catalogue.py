"""keras-hub's 24 text causal LMs under every distribution mode (issue #24).

Each tiny causal LM of `tests/hub_catalogue.py` is fitted with keras-hub's
own `fit` (2 epochs, a ragged last batch) and asked to `generate()`
greedily under each mode of `hub_catalogue.MODES` (DataParallel on 2 and 4
processes, generic last-dim, FSDP-style and 2x2 layouts, and the
backbone's own layout map on (1, 2) and (2, 2)), and must give what
pristine Keras 3.15.1 gives in one process: the epoch losses (rtol 1e-4),
the final weights (rtol 1e-3), the generated tokens (exactly), on every
rank, the ranks agreeing, and the variables of a model-parallel layout
sharded. Every mode is one process group (one `run_on_ranks` call); a
model that raises fails alone, one that hangs is ended by its watchdog.

What still fails is listed in `KNOWN_FAILURES` with the kind of its
failure, as a strict xfail that must fail that way: a fix, or another
failure, fails the test until the entry is changed.

By default only `CI_CASES` run: every mode once, and each kind of failure
of `KNOWN_FAILURES`. The full sweep (every model in every mode):

    KERAS_HUB_FULL=1 ./run_tests.sh tests/test_keras_hub_catalogue.py

or, as a table with the failures by kind and Llama's fallbacks under its
own layout on (2, 2):

    KERAS_BACKEND=torch .venv/bin/python -m tests.hub_catalogue --details
"""

import math
import os

import numpy as np
import pytest

from tests import hub_catalogue as hc
from tests import layer_catalogue as lc
from tests.harness import run_on_ranks

FULL = os.environ.get("KERAS_HUB_FULL") == "1"

# The start of a failure's kind (see `hub_catalogue.failure_kind`) ->
# modes -> models.
_KNOWN_FAILURES = {
    # Empty since the closing of issue #24's list: Falcon's key bias (Adam's
    # epsilon, see `hub_catalogue.build_causal_lm`), Qwen3.5's stack of
    # caches outside any layer (`layer_call.hold_replication`), and its
    # minutes-long first step on a 2-D mesh (strided shards gathered,
    # `fallback._without_strided_shards`).
}

# `{(mode, model): the start of the kind of its failure}`.
KNOWN_FAILURES = {
    (mode, name): kind
    for kind, groups in _KNOWN_FAILURES.items()
    for modes, names in groups.items()
    for mode in modes.split()
    for name in names.split()
}

# mode -> the models CI runs: every mode once, a model with its own layout
# map in each, every kind of failure of `KNOWN_FAILURES`, and the models
# whose failures were mended last (Qwen3_5's caches outside any layer,
# Falcon's key bias).
CI_CASES = {
    # A mixture of experts: its experts' block alone through DTensor.
    "dp": ("Falcon", "QwenMoe"),
    "dp4": ("Qwen",),
    "mp_last": ("Qwen3_5",),
    "fsdp": ("Llama",),
    "2x2": ("Gemma",),
    "own_1x1": ("Gemma",),
    # Gemma's one key/value head, uneven on the model axis; Llama's kernels
    # sharded over both axes.
    "own_1x2": ("Gemma",),
    "own_2x2": ("Llama",),
    # AutoModelParallel: a model with one key/value head (indivisible); a
    # 4-way model axis, and a model whose replicated weights would pass
    # `auto_plan.SHARE_BOUND` there; experts on a 2-D mesh.
    "auto_1x2": ("Gemma",),
    "auto_1x4": ("Llama", "RWKV7"),
    "auto_2x2": ("Qwen3Moe",),
}
# Failure kinds CI leaves to the full sweep: each costs the watchdog.
NOT_IN_CI = ("Hang: its watchdog ended it",)

CASES = (
    {mode: hc.models_for(mode) for mode in hc.DISTRIBUTED_MODES}
    if FULL
    else CI_CASES
)
# Seconds a test may take: the first of a mode runs all its models.
TIMEOUT = hc.CALL_OVERHEAD + hc.MODEL_TIMEOUT * len(hc.MODELS)


class KnownFailure(AssertionError):
    """The model failed the way `KNOWN_FAILURES` says it does."""


def test_known_failures_and_ci_cases_name_modes_and_models():
    for mode, name in KNOWN_FAILURES:
        assert name in hc.models_for(mode), (mode, name)
    assert set(CI_CASES) == set(hc.DISTRIBUTED_MODES)
    for mode, names in CI_CASES.items():
        assert set(names) <= set(hc.models_for(mode)), mode
    # Every kind of failure is run by CI.
    kinds = {k for k in KNOWN_FAILURES.values() if k not in NOT_IN_CI}
    covered = {
        kind
        for (mode, name), kind in KNOWN_FAILURES.items()
        if name in CI_CASES[mode]
    }
    assert kinds == covered, kinds - covered


def test_a_layout_other_than_the_maps_is_a_failure():
    """Under the backbone's own map, every variable is laid out as the map
    says; under a generic layout, some variable is sharded."""
    asked = {"a": "(Replicate(), Shard(dim=0))", "b": "(Replicate(),)"}
    laid_out = dict(asked, b="(Shard(dim=0),)")
    right = {"placements": asked, "expected_placements": asked}
    wrong = {"placements": laid_out, "expected_placements": asked}
    assert hc.check_sharded("own_1x2", [right, right]) is None
    problem = hc.check_sharded("own_1x2", [right, wrong])
    assert "not laid out as its layout map says: ['b']" in problem
    replicated = {"placements": {"a": "(Replicate(),)"}}
    assert "no variable is sharded" in hc.check_sharded("2x2", [replicated])
    assert hc.check_sharded("dp", [replicated]) is None


# Models that passed in one run and failed in the next in issue #24 (main
# 155c6c5, four identical runs); CI repeats the cheap ones.
FORMERLY_FLAKY = (
    {"mp_last": ("QwenMoe", "Gemma3"), "fsdp": ("QwenMoe",)}
    if FULL
    else {"mp_last": ("QwenMoe",)}
)
REPEATS = 3 if FULL else 2


# Models whose key/value heads `AutoModelParallel` replicates, and the
# meshes they run on (see `hub_catalogue.VARIANT_OF`).
GROUPED_MODES = ("auto_1x2", "auto_1x4")
GROUPED = tuple(hc.VARIANT_OF)


@pytest.fixture(scope="module")
def reference():
    """`{model: result}` in one process, pristine Keras."""
    names = {n for names in CASES.values() for n in names}
    names |= {n for names in FORMERLY_FLAKY.values() for n in names}
    names |= set(GROUPED)
    return hc.compute_reference(sorted(names))


@pytest.fixture(scope="module")
def mode_results():
    """`mode_results(mode)`: `{model: [per-rank result]}`, computed once."""
    cache = {}

    def get(mode):
        if mode not in cache:
            cache[mode] = hc.run_mode(mode, CASES[mode], log=print)
        return cache[mode]

    return get


@pytest.mark.timeout(hc.REFERENCE_TIMEOUT)
def test_reference_is_pristine_keras_and_trains(reference):
    assert reference["keras_version"] == "3.15.1"
    for name, result in reference["results"].items():
        assert "error" not in result, (name, result.get("traceback"))
        assert all(math.isfinite(v) for v in result["losses"]), name
        # The weights moved: the comparison is not of initial values.
        assert result["losses"][0] != result["losses"][1], name
        # Generation filled the prompts' padding.
        assert (result["tokens"] != 0).sum() > hc.PROMPT_LEN, name


def _params():
    pairs = [(mode, name) for mode, names in CASES.items() for name in names]
    return lc.known_failure_params(pairs, KNOWN_FAILURES, TIMEOUT, KnownFailure)


@pytest.mark.parametrize("mode, name", _params())
def test_model_equals_one_process(mode, name, reference, mode_results):
    per_rank = mode_results(mode)[name]
    expected = reference["results"][name]
    kind = hc.failure_kind(mode, per_rank, expected)
    if kind is None:
        return
    problems = hc.compare(per_rank, expected)
    message = f"{mode} {name}: {kind}\n" + "\n".join(problems[:10])
    known = KNOWN_FAILURES.get((mode, name))
    if known is not None and kind.startswith(known):
        raise KnownFailure(message)
    tracebacks = [r.get("traceback", "") for r in per_rank]
    pytest.fail(message + "\n" + next((t for t in tracebacks if t), ""))


# The bound of `AutoModelParallel`'s parameter bytes on one process: 1/N of
# the model plus this fraction of it (the replicated norm scales and biases).
AUTO_BYTES_SLACK = 0.05


@pytest.mark.parametrize(
    "mode, name",
    [
        (m, n)
        for m, names in CASES.items()
        if m.startswith("auto")
        for n in names
    ],
)
def test_auto_plan_stores_a_share_of_the_model(mode, name, mode_results):
    per_rank = mode_results(mode)[name]
    num_processes = hc.world_size(mode)
    for rank, result in enumerate(per_rank):
        assert "error" not in result, result.get("traceback")
        local, total = result["parameter_bytes"]
        bound = total / num_processes + AUTO_BYTES_SLACK * total
        assert local <= bound, (mode, name, rank, local, total)


def _repeat_body(rank, world_size, mode, names, repeats):
    """Each of `names` under `mode`, `repeats` times in a row."""
    import keras_hub  # noqa: F401 - imported once, outside the runs.

    return {
        name: [hc.run_guarded(name, mode) for _ in range(repeats)]
        for name in names
    }


@pytest.mark.parametrize("mode", sorted(FORMERLY_FLAKY))
@pytest.mark.timeout(TIMEOUT)
def test_formerly_flaky_models_give_the_same_numbers_every_time(
    mode, reference
):
    """Every repetition equals one process, and the others bit for bit."""
    names = FORMERLY_FLAKY[mode]
    per_rank = run_on_ranks(
        _repeat_body,
        world_size=hc.world_size(mode),
        args=(mode, names, REPEATS),
        timeout=hc.CALL_OVERHEAD + hc.MODEL_TIMEOUT * REPEATS * len(names),
    )
    for name in names:
        expected = reference["results"][name]
        runs = [[rank[name][i] for rank in per_rank] for i in range(REPEATS)]
        for i, run in enumerate(runs):
            problems = hc.compare(run, expected)
            assert not problems, (mode, name, i, problems[:5])
        first = runs[0][0]
        for i, run in enumerate(runs[1:], start=1):
            assert run[0]["losses"] == first["losses"], (name, i)
            for a, b in zip(run[0]["weights"], first["weights"]):
                np.testing.assert_array_equal(a, b, f"{name} run {i}")


@pytest.fixture(scope="module")
def grouped_results():
    return {
        mode: hc.run_mode(mode, GROUPED, log=print) for mode in GROUPED_MODES
    }


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("mode", GROUPED_MODES)
def test_replicated_key_value_heads_equal_one_process(
    mode, reference, grouped_results
):
    """Key/value heads that the model axis does not divide, beside split
    query heads, are replicated over it (`auto_plan`), their gradients
    computed as partial sums (`layer_call`, `shard_local`): the numbers are
    one process', within the memory bound."""
    num_processes = hc.world_size(mode)
    replicated = 0
    for name in GROUPED:
        per_rank = grouped_results[mode][name]
        problems = hc.compare(per_rank, reference["results"][name])
        tracebacks = [r.get("traceback", "") for r in per_rank]
        assert not problems, "\n".join(
            [f"{mode} {name}"] + problems[:10]
        ) + next((t for t in tracebacks if t), "")
        local, total = per_rank[0]["parameter_bytes"]
        assert local <= total / num_processes + AUTO_BYTES_SLACK * total
        placements = per_rank[0]["placements"]
        kernels = {
            kind: [
                p
                for path, p in placements.items()
                if path.endswith("kernel") and f"/{kind}" in path
            ]
            for kind in ("query", "key", "value")
        }
        assert all(kernels.values()), (name, sorted(placements))
        assert all("Shard" in p for p in kernels["query"]), (name, kernels)
        model_size = hc.MODES[mode][0][1]
        if hc.CONFIGS[name]["num_key_value_heads"] % model_size == 0:
            continue  # Heads the model axis divides: split as the query's.
        for kind in ("key", "value"):
            assert not any("Shard" in p for p in kernels[kind]), (
                name,
                kernels,
            )
        replicated += 1
    # Each mesh replicates some model's key/value heads.
    assert replicated, mode


# Under `DataParallel` every model runs on each process' rows (the probe
# of `batch_coupling` finds it per-sample), but these: the model's path
# (`hub_catalogue.train_path`) starts with the text given.
HUB_DATA_PARALLEL_PATHS = {
    # The experts' auxiliary loss sums over the batch: each mixture of
    # experts block alone runs through DTensor (`coupled_layers`).
    **{
        name: "local but coupled layers: sums over the batch"
        for name in ("Mixtral", "Qwen3Moe", "Qwen3_5Moe", "QwenMoe")
    },
    # A rotary layer built by none of its calls: the model is never
    # final for the probe, which leaves it to DTensor.
    "SmolLM": "",
    "SmolLM3": "",
}


@pytest.mark.parametrize(
    "mode, name",
    [
        (m, n)
        for m, names in CASES.items()
        if hc.MODES[m][1] == "data_parallel"
        for n in names
    ],
)
def test_data_parallel_path(mode, name, mode_results):
    """Each model's train step on the local rows, gathering nothing over
    the batch axis after the probe's step, or why not."""
    expected = HUB_DATA_PARALLEL_PATHS.get(name, "local")
    # The rows of each step: a last batch of fewer rows than processes
    # leaves some without any, and runs through DTensor.
    rows = [
        min(hc.BATCH, hc.NUM_SAMPLES - start)
        for start in range(0, hc.NUM_SAMPLES, hc.BATCH)
    ] * hc.EPOCHS
    split = [n >= hc.world_size(mode) for n in rows]
    for result in mode_results(mode)[name]:
        path = result.get("path", result.get("error"))
        if expected.startswith("local"):
            assert path == expected or (
                expected != "local" and path.startswith(expected)
            ), path
            gathered = result["gathered_bytes"]
            assert len(gathered) == len(rows), gathered
            assert not any(g for g, s in zip(gathered[1:], split[1:]) if s), (
                gathered
            )
        else:
            assert path.startswith(expected), path
