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

import pytest

from tests import hub_catalogue as hc

FULL = os.environ.get("KERAS_HUB_FULL") == "1"

# The start of a failure's kind (see `hub_catalogue.failure_kind`) ->
# modes -> models.
_KNOWN_FAILURES = {}

# `{(mode, model): the start of the kind of its failure}`.
KNOWN_FAILURES = {
    (mode, name): kind
    for kind, groups in _KNOWN_FAILURES.items()
    for modes, names in groups.items()
    for mode in modes.split()
    for name in names.split()
}

# mode -> the models CI runs: every mode, a model with its own layout map
# in each, and every kind of failure of `KNOWN_FAILURES`.
CI_CASES = {
    "dp": ("Gemma",),
    "dp4": ("Qwen",),
    "mp_last": ("Llama",),
    "fsdp": ("Gemma3",),
    "2x2": ("Qwen3Moe",),
    "own_1x2": ("Gemma",),
    "own_2x2": ("Qwen",),
}

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
    kinds = {kind for (mode, name), kind in KNOWN_FAILURES.items()}
    covered = {
        kind
        for (mode, name), kind in KNOWN_FAILURES.items()
        if name in CI_CASES[mode]
    }
    assert kinds == covered, kinds - covered


@pytest.fixture(scope="module")
def reference():
    """`{model: result}` in one process, pristine Keras."""
    names = sorted({n for names in CASES.values() for n in names})
    return hc.compute_reference(names)


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
    params = []
    for mode, names in CASES.items():
        for name in names:
            marks = [pytest.mark.timeout(TIMEOUT)]
            kind = KNOWN_FAILURES.get((mode, name))
            if kind is not None:
                marks.append(
                    pytest.mark.xfail(
                        strict=True, raises=KnownFailure, reason=kind
                    )
                )
            params.append(pytest.param(mode, name, marks=marks))
    return params


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
