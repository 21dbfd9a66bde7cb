"""End-to-end runs of the training examples under torchrun.

Each example runs once per configuration (module-scoped fixtures, tiny sizes
through its flags) and the tests check what it printed and saved:

* `examples/train_data_parallel.py` on 2 processes, and as one plain
  process: the same losses (same seed, same global batches, no shuffling).
* `examples/train_model_parallel.py` (the README's main job) on a 1x2
  (batch, model) mesh, and as one plain process: the LayoutMap shards the
  intended kernels, and the losses are those of the single process. (Its
  2x2 mesh, `--model-parallel 2` on 4 processes, is the same code on a
  batch axis too, which `tests/` covers; CI leaves it out for time.)
* `examples/finetune_auto_parallel.py` (keras-hub, `AutoModelParallel`, no
  layout map) on 2 processes and as one: the same losses and tokens, and
  the summary says the plan placed the variables.

The saved `.keras` files are loaded here, in the pytest process (no
distribution), and must give the loss the example reported.

All runs are on CPU with gloo (no GPU visible to the children), whatever the
machine has, so the results do not depend on it.
"""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

# The saved models are loaded here: keras must run on torch.
os.environ["KERAS_BACKEND"] = "torch"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras  # noqa: E402
from tests.harness import run_torchrun  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DATA_PARALLEL = REPO / "examples" / "train_data_parallel.py"
MODEL_PARALLEL = REPO / "examples" / "train_model_parallel.py"
AUTO_PARALLEL = REPO / "examples" / "finetune_auto_parallel.py"
# Two epochs of two global batches: keras-hub's fit and generate.
AUTO_ARGS = ["--samples", 16, "--batch-size", 8, "--epochs", 2]
TIMEOUT = 300

# Tiny sizes: a few steps per epoch, a few seconds per run.
DP_SAMPLES = 256
DP_ARGS = ["--samples", DP_SAMPLES, "--batch-size", 64, "--epochs", 3]
# The model axis splits heads, embed_dim and MLP units: multiples of 2.
# The global batch (16) splits over the 2 data-parallel groups of the 2x2 mesh.
MP_SAMPLES, SEQUENCE_LENGTH, EMBED_DIM, NUM_HEADS = 64, 8, 16, 4
MP_ARGS = [
    "--samples",
    MP_SAMPLES,
    "--batch-size",
    16,
    "--epochs",
    2,
    "--sequence-length",
    SEQUENCE_LENGTH,
    "--embed-dim",
    EMBED_DIM,
    "--num-heads",
    NUM_HEADS,
    "--num-blocks",
    1,
]

# Variables the model-parallel LayoutMap must split along the `model` mesh
# axis, with the tensor dimension it splits.
MODEL_SHARDED_DIM = {
    "embedding/token_embedding/embeddings": 1,
    "embedding/position_embedding/embeddings": 1,
    "block_0/attention/query/kernel": 1,
    "block_0/attention/key/kernel": 1,
    "block_0/attention/value/kernel": 1,
    "block_0/attention/query/bias": 0,
    "block_0/attention/attention_output/kernel": 0,
    "block_0/mlp_up/kernel": 1,
    "block_0/mlp_up/bias": 0,
    "block_0/mlp_down/kernel": 0,
}
# And variables that must stay whole on every process.
REPLICATED = [
    "block_0/attention/attention_output/bias",
    "block_0/attention_norm/gamma",
    "block_0/mlp_down/bias",
    "logits/kernel",
]


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _cpu_env():
    # No GPU for the children: CPU processes on gloo on every machine.
    return {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def _run_single_process(script, args):
    """Runs `script` as a plain `python` process (no torchrun)."""
    env = dict(os.environ, KERAS_BACKEND="torch", **_cpu_env())
    python_path = [str(REPO)] + env.get("PYTHONPATH", "").split(os.pathsep)
    env["PYTHONPATH"] = os.pathsep.join(p for p in python_path if p)
    result = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _run_distributed(script, *, nproc, args):
    """Runs `script` under torchrun; fails unless every rank exits with 0."""
    result = run_torchrun(
        script, nproc=nproc, args=args, timeout=TIMEOUT, env=_cpu_env()
    )
    # An abort at interpreter exit (e.g. a C++ thread alive at teardown).
    assert "terminate called" not in result.stderr, result.stderr
    return result.stdout


def _result(stdout):
    """Returns the RESULT json, which only rank 0 prints, exactly once."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, stdout
    return json.loads(lines[0][len("RESULT ") :])


def _check_trained(result):
    """Losses are finite and the last epoch's is below the first's."""
    losses = result["epoch_losses"]
    assert len(losses) >= 2
    assert all(math.isfinite(loss) for loss in losses), losses
    assert losses[-1] < losses[0], losses
    assert math.isfinite(result["loss"])


def _assert_losses_match(result, reference):
    np.testing.assert_allclose(
        result["epoch_losses"], reference["epoch_losses"], rtol=1e-4, atol=1e-6
    )
    np.testing.assert_allclose(
        result["loss"], reference["loss"], rtol=1e-4, atol=1e-6
    )


def _summary_rows(stdout):
    """Parses a printed sharding summary.

    Returns:
        `{path: (rank, placements, local shape, layout rule)}`.
    """
    rows = {}
    for line in stdout.splitlines():
        match = re.match(r"\[rank (\d+)\] (.*)$", line)
        if not match:
            continue
        # Columns are separated by 2+ spaces; cells hold single spaces.
        cells = re.split(r"\s{2,}", match.group(2).strip())
        if len(cells) != 6 or cells[0] == "path":
            continue
        path, _, placements, local_shape, _, rule = cells
        rows[path] = (int(match.group(1)), placements, local_shape, rule)
    return rows


def _check_megatron_layouts(stdout, model_parallel):
    """The summary (rank 0's only) shows the intended Megatron layouts."""
    rows = _summary_rows(stdout)
    assert rows, stdout
    assert {row[0] for row in rows.values()} == {0}
    # Mesh (batch, model): nothing is split along `batch`.
    for path, dim in MODEL_SHARDED_DIM.items():
        assert rows[path][1] == f"R, S({dim})", (path, rows[path])
        assert rows[path][3] != "(no rule)", (path, rows[path])
    for path in REPLICATED:
        assert rows[path][1] == "R, R", (path, rows[path])
        assert rows[path][3] == "(no rule)", (path, rows[path])
    # What this process stores: its share of the heads and MLP units.
    local_heads = NUM_HEADS // model_parallel
    head_dim = EMBED_DIM // NUM_HEADS
    assert rows["block_0/attention/query/kernel"][2] == str(
        (EMBED_DIM, local_heads, head_dim)
    )
    assert rows["block_0/mlp_down/kernel"][2] == str(
        (4 * EMBED_DIM // model_parallel, EMBED_DIM)
    )


def _import_example(path):
    """Imports an example as a module (this registers its custom layers)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _loss_of_saved_model(path, inputs, targets, loss_fn):
    """Loads a saved model in this process; returns its loss on the data."""
    model = keras.saving.load_model(path)
    predictions = model.predict(inputs, verbose=0)
    assert predictions.shape[:-1] == targets.shape
    assert np.all(np.isfinite(predictions))
    return float(keras.ops.convert_to_numpy(loss_fn(targets, predictions)))


# --------------------------------------------------------------------------
# Runs (each once per module)
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def output_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("examples")


@pytest.fixture(scope="module")
def data_parallel_2(output_dir):
    output = output_dir / "data_parallel_2.keras"
    args = DP_ARGS + ["--output", output]
    return _run_distributed(DATA_PARALLEL, nproc=2, args=args), output


@pytest.fixture(scope="module")
def data_parallel_1(output_dir):
    output = output_dir / "data_parallel_1.keras"
    args = DP_ARGS + ["--output", output]
    return _run_single_process(DATA_PARALLEL, args), output


@pytest.fixture(scope="module")
def model_parallel_1(output_dir):
    output = output_dir / "model_parallel_1.keras"
    args = MP_ARGS + ["--output", output]
    return _run_single_process(MODEL_PARALLEL, args), output


@pytest.fixture(scope="module")
def model_parallel_2(output_dir):
    output = output_dir / "model_parallel_2.keras"
    args = MP_ARGS + ["--output", output]
    return _run_distributed(MODEL_PARALLEL, nproc=2, args=args), output


# --------------------------------------------------------------------------
# Data parallel
# --------------------------------------------------------------------------


def test_data_parallel_trains_on_two_processes(data_parallel_2):
    stdout, output = data_parallel_2
    result = _result(stdout)
    assert result["world_size"] == 2
    _check_trained(result)
    assert output.is_file()


def test_data_parallel_matches_one_process(data_parallel_1, data_parallel_2):
    reference = _result(data_parallel_1[0])
    assert reference["world_size"] == 1
    _assert_losses_match(_result(data_parallel_2[0]), reference)


def test_data_parallel_saved_model_loads_and_predicts(data_parallel_2):
    stdout, output = data_parallel_2
    example = _import_example(DATA_PARALLEL)
    features, labels = example.make_dataset(DP_SAMPLES)
    loss = _loss_of_saved_model(
        output, features, labels, keras.losses.SparseCategoricalCrossentropy()
    )
    # The file holds the trained weights: the loss the example evaluated.
    np.testing.assert_allclose(loss, _result(stdout)["loss"], rtol=1e-4)


# --------------------------------------------------------------------------
# Model parallel
# --------------------------------------------------------------------------


def test_model_parallel_on_1x2_mesh(model_parallel_2, model_parallel_1):
    stdout, output = model_parallel_2
    result = _result(stdout)
    assert result["mesh_shape"] == [1, 2]
    _check_trained(result)
    _check_megatron_layouts(stdout, model_parallel=2)
    _assert_losses_match(result, _result(model_parallel_1[0]))
    assert output.is_file()


def test_model_parallel_saved_model_loads_and_predicts(model_parallel_2):
    stdout, output = model_parallel_2
    # Importing the example registers its custom layers for loading.
    example = _import_example(MODEL_PARALLEL)
    inputs, targets = example.make_dataset(MP_SAMPLES, SEQUENCE_LENGTH)
    loss = _loss_of_saved_model(
        output,
        inputs,
        targets,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    # The file holds the trained weights: the loss the example evaluated.
    np.testing.assert_allclose(loss, _result(stdout)["loss"], rtol=1e-4)


# --------------------------------------------------------------------------
# AutoModelParallel (keras-hub)
# --------------------------------------------------------------------------


def test_auto_parallel_example_matches_one_process():
    pytest.importorskip("keras_hub")
    distributed = _run_distributed(AUTO_PARALLEL, nproc=2, args=AUTO_ARGS)
    single = _result(_run_single_process(AUTO_PARALLEL, AUTO_ARGS))
    result = _result(distributed)
    np.testing.assert_allclose(
        result["epoch_losses"], single["epoch_losses"], rtol=1e-4, atol=1e-6
    )
    assert result["generated"] == single["generated"]
    assert result["mesh_shape"] == [1, 2]
    # The plan, not a rule, placed the variables, and sharded some.
    assert "auto: column-parallel over heads" in distributed
    assert "auto: embedding vocabulary" in distributed
