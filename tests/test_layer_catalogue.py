"""Every layer of `keras.layers` trains under a distribution as in one process.

The cases are those of `tests/layer_catalogue.py`: one tiny model per
class `keras.layers` exports (or a reason in `NOT_CASES`), trained for 2
epochs with a ragged last batch. The reference is every case trained in
one fresh interpreter with pristine Keras 3.15.1 (no project code), and
for the cases that draw random numbers (drawn by position under a
distribution, not from torch's generators) the same case on one process
under `DataParallel`, whose numbers every layout must give; each
distributed run (see `layer_catalogue.RUNS`) trains every case in one
process group, and each (run, case) is one test here: per-epoch losses
(rtol 1e-4, atol 1e-6) and final weights (rtol 1e-3, atol 1e-5) equal the
reference on every rank, the ranks agree, and every variable given a
layout is sharded.

Cases that fail today are listed in `KNOWN_FAILURES` with the kind of their
failure; they are strict xfails that must fail that way: a case that
starts to pass, or fails another way, fails the test, so the table stays
true.

CI runs `CI_RUNS`: DataParallel on `CI_CASES`, a subset that keeps every
failure kind the runs had and a case of most families of layers, and the
2x2 layout (4 processes, both mesh axes, the slowest run) on the part of
it that a model axis runs otherwise than DataParallel does, and a few
cases with their weights sharded over the batch axis (`fsdp`).
`KERAS_CATALOGUE_FULL=1` runs every run on every case (20-27 min on 2
shared cores); `scripts/catalogue_sweep.sh` runs the same sweep and prints it as
a table.
"""

import dataclasses
import math
import os

import numpy as np
import pytest

from tests import layer_catalogue as lc

FULL = os.environ.get("KERAS_CATALOGUE_FULL") == "1"


# A case of most families of layers, and every case that once failed in
# a way of its own (a regression shows in CI).
CI_CASES = (
    "Dense",
    "Embedding",
    "Conv2D",
    "MaxPooling2D",
    "MaxPooling3D",
    "AveragePooling2D",
    "AdaptiveMaxPooling2D",
    "AdaptiveAveragePooling3D",
    "SimpleRNN",
    "GRU",
    "LSTM",
    "ConvLSTM2D",
    "BatchNormalization",
    "RMSNormalization",
    "MultiHeadAttention",
    "Flatten",
    "Dropout",
    "Dropout-unseeded",
    "ActivityRegularization",
    "CategoryEncoding",
    "MelSpectrogram",
    "Resizing",
    "SpectralNormalization",
    "AugMix",
    "RandomFlip",
    "RandomBrightness",
    "RandAugment",
    "CutMix",
)

# Sharded weights and the DTensor fallback on a model axis: kernels of each
# kind, what was once refused a sharding strategy, per-rank randomness.
CI_MODEL_AXIS_CASES = (
    "Dense",
    "Embedding",
    "Conv2D",
    "MaxPooling3D",
    "SimpleRNN",
    "ConvLSTM2D",
    "BatchNormalization",
    "MultiHeadAttention",
    "Dropout-unseeded",
)
# Weights and statistics sharded over the batch axis: a batch
# normalization's moving mean, updated with the batch's mean (an average
# over the batch axis), was once twice one process' there.
CI_BATCH_AXIS_CASES = ("Dense", "BatchNormalization", "MultiHeadAttention")
# run -> the cases CI runs in it.
CI_RUNS = {
    "dp2": CI_CASES,
    "2x2": CI_MODEL_AXIS_CASES,
    "fsdp": CI_BATCH_AXIS_CASES,
}

RUNS = {run: tuple(lc.CASES) for run in lc.RUNS} if FULL else CI_RUNS
CASES = tuple(lc.CASES) if FULL else CI_CASES
# Seconds the first test of a run may take: it runs all the run's cases
# (4 processes on 2 cores take ~2.5 s a case; restarts after a hang more).
RUN_TIMEOUT = 300 + 10 * len(CASES)


# The cases that fail today (torch 2.13), as `scripts/catalogue_sweep.sh
# --known-failures` prints them: the start of the failure's kind (see
# `layer_catalogue.failure_kind`) -> runs -> case names.
_KNOWN_FAILURES = {}

# `{(run, case): the start of the kind of its failure}`.
KNOWN_FAILURES = {
    (run, name): kind
    for kind, groups in _KNOWN_FAILURES.items()
    for runs, names in groups.items()
    for run in runs.split()
    for name in names.split()
}


class KnownFailure(AssertionError):
    """The case failed the way `KNOWN_FAILURES` says it does."""


# Under DataParallel every case runs on each process' rows (the probe of
# `batch_coupling` finds it per-sample; random draws by position included),
# but these, which run through DTensor for the reason given (the start of
# the probe's reason).
DATA_PARALLEL_ON_DTENSOR = {
    # Its displacement noise comes from torch's generator (the backend's
    # `elastic_transform`), not from a draw by position: as much of it as
    # the rows are.
    "RandomElasticTransform": "draws from a global generator otherwise",
    # Its normalized kernel is written in the call, then differentiated.
    "SpectralNormalization": "assigns a trainable variable",
    # The wrapped module computes with its own (replicated) parameters.
    "TorchModuleWrapper": "its outputs on the local rows are not plain",
}
# Cases on the local rows but for their layer, which couples samples and
# runs through DTensor alone (`coupled_layers`), for the reason given.
_MIXES = "its outputs on the local rows differ"
COUPLED_LAYER_ON_DTENSOR = {
    # A loss summed over the global batch.
    "ActivityRegularization": "sums over the batch",
    "Dense-activity_regularizer": "sums over the batch",
    # Samples mixed with other samples of the batch: the layer whose
    # outputs on the local rows first differ.
    "CutMix": _MIXES,
    "MixUp": _MIXES,
    # A histogram of the whole batch.
    "Equalization": _MIXES,
}
# Per run: a draw of a fixed shape whose first dimension is the number of
# each process' rows (2 of the 8 on 4 processes) is taken for rows: the
# probe finds the layer's outputs differ (`RandomGaussianBlur`'s 2 blur
# factors, `RandAugment`'s), and that layer runs through DTensor.
COUPLED_LAYER_ON_DTENSOR_IN_RUN = {
    "dp4": {"RandomGaussianBlur": _MIXES, "RandAugment": _MIXES},
}
# Coupled layers that gather over the batch axis in every step, and why:
# ops DTensor refuses, computed on the global values of their input.
GATHERING_COUPLED_LAYERS = {
    "Equalization": "its histogram of the whole batch",
}
GATHERING_COUPLED_LAYERS_IN_RUN = {
    "dp4": {"RandAugment": "its image transforms, refused by DTensor"},
}


# --------------------------------------------------------------------------
# The catalogue itself (no processes)
# --------------------------------------------------------------------------


def test_catalogue_covers_keras_layers():
    """Each class of `keras.layers` is a case, an alias or a non-case."""
    exported = lc.exported_layer_classes()
    covered = lc.covered_layers()
    aliases = set(lc.ALIASES)
    not_cases = set(lc.NOT_CASES)
    assert not covered & aliases, covered & aliases
    assert not covered & not_cases, covered & not_cases
    assert not aliases & not_cases, aliases & not_cases
    placed = covered | aliases | not_cases
    assert placed == exported, (
        f"not in the catalogue: {sorted(exported - placed)}; "
        f"not in keras.layers: {sorted(placed - exported)}"
    )
    import keras

    for alias, name in lc.ALIASES.items():
        assert getattr(keras.layers, alias) is getattr(keras.layers, name)
        assert name in covered, alias


def test_variable_axes():
    """The layouts of the modes, on a few shapes."""
    shape = (4, 3, 6)
    assert lc.variable_axes(shape, "mp_last") == (None, None, "model")
    assert lc.variable_axes(shape, "mp_first") == ("model", None, None)
    assert lc.variable_axes(shape, "fsdp") == ("batch", None, None)
    assert lc.variable_axes(shape, "2x2") == ("batch", None, "model")
    assert lc.variable_axes((3, 4), "2x2") == (None, "model")
    assert lc.variable_axes((3, 5), "mp_last") is None
    with pytest.raises(ValueError, match="no variable layouts"):
        lc.variable_axes(shape, "dp")


def test_known_failures_name_runs_and_cases():
    """The table of known failures names existing runs and cases."""
    for run, name in KNOWN_FAILURES:
        assert run in lc.RUNS, run
        assert name in lc.CASES, name
    assert set(CI_CASES) <= set(lc.CASES)
    assert set(CI_RUNS) <= set(lc.RUNS)
    for names in CI_RUNS.values():
        assert set(names) <= set(CI_CASES), names


def test_error_kind():
    """The first line of the innermost message of a Keras layer error."""
    error = RuntimeError(
        "Exception encountered when calling Dense.call().\n\n"
        "\x1b[1mCannot flatten unevenly sharded tensor: size 7\n\n"
        "more\x1b[0m\n\nArguments received by Dense.call():\n"
    )
    assert lc.error_kind(error) == (
        "RuntimeError: Cannot flatten unevenly sharded tensor: size 7"
    )
    try:
        raise AssertionError  # Without a message, as DTensor raises it.
    except AssertionError as bare:
        assert lc.error_kind(bare) == (
            "AssertionError in test_layer_catalogue.py:test_error_kind"
        )


def _result(losses=(0.5, 0.25), placement="(Shard(dim=1),)"):
    """A `run_case` result of one 2x3 kernel laid out by one rule."""
    return {
        "losses": list(losses),
        "weights": [np.arange(6.0).reshape(2, 3)],
        "paths": ["dense/kernel"],
        "placements": {"dense/kernel": placement},
        "rules": {"dense/kernel": (None, "model")},
        "layer_classes": ["Dense"],
    }


def test_compare():
    """`compare` and `failure_kind` see what differs from one process."""
    reference = _result(placement="()")
    same = [_result(), _result()]
    assert lc.compare(same, reference) == []
    assert lc.failure_kind(same, reference) is None

    moved = [_result(), _result(losses=(0.5, 0.2501))]
    assert any("losses differ" in p for p in lc.compare(moved, reference))
    assert lc.failure_kind(moved, reference) == (
        "numbers differ from one process"
    )

    replicated = [_result(placement="(Replicate(),)")] * 2
    assert "stayed replicated" in lc.compare(replicated, reference)[0]

    failed = [{"error": "JobFailedError: process 1 failed"}, same[1]]
    failed[1] = {"error": "RuntimeError: bad shape 7"}
    assert lc.failure_kind(failed, reference) == "RuntimeError: bad shape #"
    one_failed = [same[0], {"error": "RuntimeError: bad shape 7"}]
    assert lc.failure_kind(one_failed, reference) == (
        "on some ranks only: RuntimeError: bad shape #"
    )


# --------------------------------------------------------------------------
# The runner: a case that hangs fails alone
# --------------------------------------------------------------------------


def _hanging_build(layers, shape):
    """The "Dense" case's model, after hanging on rank 1 for an hour."""
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(3600)
    return lc.CASES["Dense"].build(layers, shape)


def _body_with_hanging_case(rank, world_size, *args):
    """`layer_catalogue.mode_body` with a case "Hang" that hangs."""
    lc.CASES["Hang"] = dataclasses.replace(
        lc.CASES["Dense"], build=_hanging_build
    )
    # The case's watchdog, not the call's deadline, ends it.
    lc.CASE_TIMEOUT = 8
    try:
        return lc.mode_body(rank, world_size, *args)
    finally:
        del lc.CASES["Hang"]


def test_a_hanging_case_fails_alone():
    """A case that hangs is ended by its watchdog; the next ones run."""
    names = ["Dense", "Hang", "Dense-activity_regularizer"]
    results = lc.run_mode(
        "dp", 2, names, body=_body_with_hanging_case, call_timeout=300
    )
    assert sorted(results) == sorted(names)
    for result in results["Hang"]:
        assert result["error"] == "Hang: its watchdog ended it", result
        # The stacks at the deadline show where it hung.
        assert "_hanging_build" in result["traceback"], result["traceback"]
    for name in ("Dense", "Dense-activity_regularizer"):
        assert ["error" in result for result in results[name]] == [
            False,
            False,
        ], name


# --------------------------------------------------------------------------
# The reference and the runs (module-scoped: computed once)
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    """`{name: result}` of the cases in one process: pristine Keras, and
    for the random cases this build under `DataParallel`."""
    return lc.full_reference(list(CASES))


@pytest.fixture(scope="module")
def run_results():
    """`run_results(run)`: `{name: [per-rank result]}`, computed once."""
    cache = {}

    def get(run):
        if run not in cache:
            mode, world_size = lc.RUNS[run]
            cache[run] = lc.run_mode(mode, world_size, RUNS[run], log=print)
        return cache[run]

    return get


@pytest.mark.timeout(RUN_TIMEOUT)
def test_reference_is_pristine_keras_and_trains(reference):
    """The reference ran upstream Keras 3.15.1 (this build on one process
    for the random cases), and every case trained."""
    assert reference["keras_version"] == "3.15.1"
    assert sorted(reference["one_process_cases"]) == sorted(
        set(CASES) & set(lc.RANDOM_CASES)
    )
    assert sorted(reference["results"]) == sorted(CASES)
    for name, result in reference["results"].items():
        assert "error" not in result, (name, result.get("traceback"))
        # The case's model holds the class it covers.
        assert lc.case_layer(name) in result["layer_classes"], name
        assert all(math.isfinite(v) for v in result["losses"]), name
        # The weights moved: the comparison is not of initial values.
        assert result["losses"][0] != result["losses"][1], name


def _params():
    pairs = [(run, name) for run, names in RUNS.items() for name in names]
    return lc.known_failure_params(
        pairs, KNOWN_FAILURES, RUN_TIMEOUT, KnownFailure
    )


def _data_parallel_params():
    return [
        (run, name)
        for run, names in RUNS.items()
        if lc.RUNS[run][0] == "dp"
        for name in names
    ]


@pytest.mark.timeout(RUN_TIMEOUT)
@pytest.mark.parametrize("run, name", _data_parallel_params())
def test_data_parallel_path(run, name, run_results):
    """Each case's train step on the local rows, gathering nothing over
    the batch axis, or why not."""
    expected = DATA_PARALLEL_ON_DTENSOR.get(name)
    coupled = COUPLED_LAYER_ON_DTENSOR_IN_RUN.get(run, {}).get(
        name, COUPLED_LAYER_ON_DTENSOR.get(name)
    )
    gathers = GATHERING_COUPLED_LAYERS_IN_RUN.get(run, {}).get(
        name, GATHERING_COUPLED_LAYERS.get(name)
    )
    for result in run_results(run)[name]:
        path = result.get("path", result.get("error"))
        if expected is None:
            if coupled is None:
                assert path == "local", path
            else:
                assert path.startswith(
                    f"local but coupled layers: {coupled}"
                ), path
            # Nothing gathered over the batch axis after the probe's step
            # (whose DTensor call may gather what DTensor refuses), but by
            # a coupled layer listed.
            gathered = result["gathered_bytes"]
            assert len(gathered) == 6, gathered
            assert bool(any(gathered[1:])) == bool(gathers), gathered
        else:
            assert path.startswith(f"dtensor: {expected}"), path


@pytest.mark.parametrize("run, name", _params())
def test_case_equals_one_process(run, name, reference, run_results):
    per_rank = run_results(run)[name]
    problems = lc.compare(per_rank, reference["results"][name])
    if not problems:
        return
    kind = lc.failure_kind(per_rank, reference["results"][name])
    message = f"{run} {name}: {kind}\n" + "\n".join(problems)
    known = KNOWN_FAILURES.get((run, name))
    if known is not None and kind.startswith(known):
        raise KnownFailure(message)
    tracebacks = [r.get("traceback", "") for r in per_rank]
    pytest.fail(message + "\n" + next((t for t in tracebacks if t), ""))
