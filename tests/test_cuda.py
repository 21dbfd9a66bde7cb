"""The CUDA paths: NCCL, one process per GPU, every tensor on its GPU.

Runs on a machine with a GPU; on one without (CI), every test here is
skipped, and says so. The rest of the suite hides the GPUs from its
processes (`tests/conftest.py`); the jobs here are given the ones this run
saw, one torchrun process per GPU (`tests/cuda_jobs.py`).

* Every case of the layer catalogue, under DataParallel, both
  ModelParallel layouts, FSDP-style weights (gathered ahead, the CUDA
  default) and AutoModelParallel, equals pristine Keras 3.15.1 trained in
  one process on the same GPU, and every variable lives on the GPU.
* The parity zoo fitted under DataParallel and ModelParallel, and the
  compiled step, equal the same fit with no distribution; a checkpoint
  saved in the background from GPU memory loads back exactly.
* The examples train on the GPU as they do in one process.
* More processes on a node than GPUs is refused with a `ValueError` that
  says what to do, not NCCL's "Duplicate GPU" at the first collective.

`NVIDIA_TF32_OVERRIDE=0` keeps cuBLAS and cuDNN in float32 in every
process: TF32 products are computed otherwise by different kernels.
"""

import concurrent.futures
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests import conftest
from tests import layer_catalogue
from tests import parity_models
from tests.harness import run_torchrun

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "tests" / "cuda_jobs.py"
# The catalogue's modes on a mesh of every GPU.
CATALOGUE_MODES = ("dp", "mp_last", "mp_first", "fsdp", "auto")
# A comma-separated list of catalogue cases runs those only (a rerun after
# a fix, on a machine lent for minutes); default every case.
CASES_ENV = "KERAS_CUDA_CATALOGUE_CASES"
TIMEOUT = 600


def _gpu_env():
    """The environment of a job given the GPUs this test run saw."""
    visible = os.environ.get(conftest.VISIBLE_GPUS_ENV, conftest.ALL_GPUS)
    if visible == conftest.ALL_GPUS:
        # Hidden from the pytest process only by conftest: count them all.
        env = dict(os.environ)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        visible = ",".join(str(i) for i in range(_device_count(env)))
    return {"CUDA_VISIBLE_DEVICES": visible, "NVIDIA_TF32_OVERRIDE": "0"}


_COUNT_GPUS = "import torch; print(torch.cuda.device_count())"


def _device_count(env):
    process = subprocess.run(
        [sys.executable, "-c", _COUNT_GPUS],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if process.returncode != 0:
        raise RuntimeError(f"counting the GPUs failed:\n{process.stderr}")
    return int(process.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def gpus():
    """`(number of GPUs, environment of a job)`; skips without a GPU."""
    env = _gpu_env()
    count = len([d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d])
    if count == 0:
        pytest.skip("no GPU on this machine: the CUDA paths are not run")
    return count, env


def _load(path):
    with open(path, "rb") as file:
        return pickle.load(file)


def _torchrun(gpus, script, *args, nproc=None, check=True, timeout=TIMEOUT):
    """Runs `script` on one process per GPU (or `nproc`)."""
    count, env = gpus
    return run_torchrun(
        script,
        nproc=nproc or count,
        args=args,
        env=env,
        check=check,
        timeout=timeout,
    )


# --------------------------------------------------------------------------
# The layer catalogue
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def catalogue_runs(gpus):
    """The pristine reference and every mode, run side by side."""
    count, env = gpus
    root = Path(tempfile.mkdtemp(prefix="cuda-catalogue-"))
    for mode in CATALOGUE_MODES:
        (root / mode).mkdir()
    names = _catalogue_cases()
    workers = len(CATALOGUE_MODES) + 1
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        reference = pool.submit(
            layer_catalogue.compute_reference,
            names,
            env=env,
            timeout=TIMEOUT,
        )
        runs = {
            mode: pool.submit(
                _torchrun, gpus, JOBS, "catalogue", mode, root / mode, *names
            )
            for mode in CATALOGUE_MODES
        }
        for run in runs.values():
            run.result()
        reference = reference.result()["results"]
    results = {}
    for mode in CATALOGUE_MODES:
        results[mode] = {
            name: [
                _load(root / mode / f"{name}.rank{rank}.pkl")
                for rank in range(count)
            ]
            for name in names
        }
    return reference, results


@pytest.mark.parametrize("mode", CATALOGUE_MODES)
def test_catalogue_layers_train_on_the_gpu_as_in_one_process(
    catalogue_runs, mode
):
    reference, results = catalogue_runs
    problems = {}
    for name, per_rank in results[mode].items():
        if _needs_tensorflow(reference[name]):
            # GPU images often have no TensorFlow; CI runs these cases.
            continue
        found = layer_catalogue.compare(per_rank, reference[name])
        if reference[name].get("devices") != ["cuda"]:
            found.append(f"reference on {reference[name].get('devices')}")
        for rank, result in enumerate(per_rank):
            devices = result.get("devices", [])
            if not devices or any(not d.startswith("cuda") for d in devices):
                found.append(f"rank {rank}: variables on {devices}")
        if found:
            problems[name] = found
    assert not problems, (
        f"{len(problems)}/{len(results[mode])} cases differ under {mode}: "
        f"{problems}"
    )


def _catalogue_cases():
    """The cases `CASES_ENV` names, else every case of the catalogue."""
    chosen = os.environ.get(CASES_ENV, "")
    names = [n for n in chosen.split(",") if n] or list(layer_catalogue.CASES)
    unknown = sorted(set(names) - set(layer_catalogue.CASES))
    if unknown:
        raise ValueError(f"{CASES_ENV} names no catalogue case: {unknown}")
    return names


def _needs_tensorflow(reference):
    """Whether a case's reference failed for want of TensorFlow
    (`Hashing`, `IntegerLookup`)."""
    error = reference.get("error", "")
    return error.startswith("ImportError") and "requires TensorFlow" in error


def test_the_catalogue_ran_on_the_gpu(catalogue_runs):
    """Every case has a reference; only the two that need TensorFlow may
    be left out."""
    reference, _ = catalogue_runs
    assert sorted(reference) == sorted(_catalogue_cases())
    left_out = sorted(n for n, r in reference.items() if _needs_tensorflow(r))
    assert set(left_out) <= {"Hashing", "IntegerLookup"}, left_out


# --------------------------------------------------------------------------
# Training, the compiled step and checkpoints
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def training(gpus):
    out = Path(tempfile.mkdtemp(prefix="cuda-training-")) / "results.pkl"
    _torchrun(gpus, JOBS, "training", out)
    return _load(out)


@pytest.mark.parametrize("kind", parity_models.MODEL_KINDS)
def test_distributed_fit_on_the_gpu_equals_one_process(training, kind):
    single = training[f"{kind}/single"]
    assert single["devices"] == ["cuda"], single["devices"]
    settings = ("dp", "mp")
    if kind in parity_models.RANDOM_KINDS:
        # Drawn by position under a distribution: any layout draws the
        # numbers `DataParallel` draws (one process' under it).
        single, settings = training[f"{kind}/dp"], ("mp",)
    for setting in settings:
        result = training[f"{kind}/{setting}"]
        assert result["devices"] == ["cuda/cuda"], (setting, result["devices"])
        parity_models.assert_close(
            result["history"], single["history"], f"{kind}/{setting}"
        )
        parity_models.assert_close(
            result["state"], single["state"], f"{kind}/{setting}"
        )


@pytest.mark.parametrize("kind", ("mlp", "batchnorm"))
def test_compiled_step_on_the_gpu_equals_one_process(training, kind):
    compiled = training[f"{kind}/dp/jit"]
    single = training[f"{kind}/single"]
    assert compiled["devices"] == ["cuda/cuda"], compiled["devices"]
    parity_models.assert_close(
        compiled["history"], single["history"], f"{kind} compiled"
    )
    parity_models.assert_close(
        compiled["state"], single["state"], f"{kind} compiled"
    )


def test_a_checkpoint_saved_from_the_gpu_loads_back_exactly(training):
    checkpoint = training["checkpoint"]
    assert checkpoint["devices"] == ["cuda"], checkpoint["devices"]
    assert len(checkpoint["loaded"]) == len(checkpoint["trained"])
    for loaded, trained in zip(checkpoint["loaded"], checkpoint["trained"]):
        np.testing.assert_array_equal(loaded, trained)


# --------------------------------------------------------------------------
# Examples and launch errors
# --------------------------------------------------------------------------


def test_examples_train_on_the_gpu_as_in_one_process(gpus, tmp_path):
    from integration_tests import test_examples as examples

    count, env = gpus
    for script, args in (
        (examples.DATA_PARALLEL, examples.DP_ARGS),
        (examples.MODEL_PARALLEL, examples.MP_ARGS),
    ):
        distributed = examples._result(_torchrun(gpus, script, *args).stdout)
        single = subprocess.run(
            [sys.executable, str(script), *map(str, args)],
            cwd=REPO,
            env=dict(os.environ, KERAS_BACKEND="torch", **env),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert single.returncode == 0, single.stdout + single.stderr
        examples._check_trained(distributed)
        examples._assert_losses_match(
            distributed, examples._result(single.stdout)
        )


def test_more_processes_than_gpus_is_a_value_error(gpus):
    count, _ = gpus
    result = _torchrun(
        gpus,
        REPO / "examples" / "hello_distribution.py",
        nproc=count + 1,
        check=False,
        timeout=180,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "ValueError" in output, output
    assert f"processes but sees {count} GPU(s)" in output, output
    assert "Duplicate GPU" not in output, output
