"""With no distribution set, a training step runs upstream Keras' code path.

The same script trains a small model in two fresh interpreters: one with this
package, one with pristine upstream Keras of the installed package's base
(3.15.1, or the Keras master nightly in `.venv-nightly`: the downloaded
wheel, first on `PYTHONPATH`). Each records every Keras function a train
step calls. Ours must call the same upstream functions in the same order;
of the distribution modules, only the hooks' own entry points may run, and
they may call nothing but the check whether a distribution is set.
"""

import concurrent.futures
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "build_backend"))
import overlaylib  # noqa: E402

BASE = overlaylib.base_of(REPO, importlib.metadata.version("keras"))
# Keras master moved the torch backend's ops under `torch/ops/`.
CORE = "keras/src/backend/torch/" + ("ops/" if BASE.variant else "") + "core.py"

# Functions our diffs add to upstream files, each a hook into our modules.
HOOK_FRAMES = {
    "keras/src/backend/torch/optimizers/torch_optimizer.py:apply",
    f"{CORE}:assign_add",
    f"{CORE}:assign_sub",
    "keras/src/backend/torch/layer.py:_parameter_key",
    "keras/src/utils/io_utils.py:_is_logging_process",
    "keras/src/backend/common/distribution_capability.py:"
    "distribution_capability",
}
# What may run of our distribution modules with no distribution set: each
# hook's entry point, and the check it starts with.
ALLOWED_DISTRIBUTION_FRAMES = {
    "training/step.py:__call__",
    "training/step.py:loss_predictions",
    "training/step.py:local_loss",
    "training/step.py:metric_predictions",
    "training/step.py:reduce_gradients",
    "training/step.py:local_metric_state",
    "training/step.py:local_metric_reads",
    "training/layer_call.py:call_layer",
    "training/gradients.py:apply_gradients",
    "core/variables.py:assign",
    "core/variables.py:operand_like",
    "core/variables.py:to_global_value",
    "tensor_parallel/shard_local.py:conv",
    "dtensor_gaps/convolution.py:conv_operands",
    "core/random_draws.py:by_position",
    "dtensor_gaps/ops.py:divide_no_nan_local",
    "dtensor_gaps/ops.py:reshape",
    "tensor_parallel/shard_local.py:einsum",
    "tensor_parallel/shard_local.py:matmul",
    "tensor_parallel/shard_local.py:attention",
    "core/runtime.py:current_distribution",
    # The step's hooks check whether a step of the model runs.
    "training/step.py:running_step",
}

SCRIPT = r"""
import json, os, sys
os.environ["KERAS_BACKEND"] = "torch"
import numpy as np
import torch
torch.set_num_threads(1)
import keras

keras.utils.set_random_seed(7)
inputs = keras.Input((6, 6, 2))
h = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
h = keras.layers.Flatten()(h)
h = keras.layers.Dense(8, activation="relu")(h)
h = keras.layers.Dropout(0.25, seed=1)(h)
h = keras.layers.LayerNormalization()(h)
outputs = keras.layers.Dense(3)(h)
model = keras.Model(inputs, outputs)
model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse",
              metrics=["mae"])
rng = np.random.default_rng(0)
x = rng.uniform(size=(8, 6, 6, 2)).astype("float32")
y = rng.uniform(size=(8, 3)).astype("float32")
losses = [float(model.train_on_batch(x, y)[0])]  # Builds everything.

package = os.path.dirname(os.path.dirname(keras.src.__file__))
calls = []

def profile(frame, event, arg):
    if event != "call":
        return
    if frame.f_code.co_filename.startswith(package):
        calls.append([name(frame), name(frame.f_back)])

def name(frame):
    if frame is None:
        return ""
    relative = os.path.relpath(frame.f_code.co_filename,
                               os.path.dirname(package))
    return f"{relative}:{frame.f_code.co_name}"

sys.setprofile(profile)
losses.append(float(model.train_on_batch(x, y)[0]))
sys.setprofile(None)
weights = [w.tolist() for w in model.get_weights()]
print("RESULT " + json.dumps({"calls": calls, "losses": losses,
                              "weights": weights}))
"""


@pytest.fixture(scope="module")
def pristine_root():
    return overlaylib.pristine_upstream(
        BASE.version, REPO / "build" / "upstream", BASE.distribution
    )


def _run(pythonpath=None):
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, result.stdout[-2000:]
    return json.loads(line[-1][len("RESULT ") :])


def test_single_process_step_runs_upstream_code_path(pristine_root):
    # The two interpreters run at once.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ours = pool.submit(_run)
        upstream = pool.submit(_run, pythonpath=pristine_root)
        ours, upstream = ours.result(), upstream.result()
    assert upstream["calls"], "the profile recorded nothing"
    upstream_calls = [callee for callee, _ in upstream["calls"]]
    assert not any("distributed" in c for c in upstream_calls)

    distributed = "keras/src/backend/torch/distributed/"
    # What the check whether a distribution is set calls is part of it.
    check = distributed + "core/runtime.py:current_distribution"
    calls = [callee for callee, caller in ours["calls"] if caller != check]
    ran = {c[len(distributed) :] for c in calls if distributed in c}
    unexpected = ran - ALLOWED_DISTRIBUTION_FRAMES
    assert not unexpected, (
        f"distribution code ran with no distribution set: {unexpected}"
    )
    # The hooks did run: the test watches the right places.
    assert {
        "training/layer_call.py:call_layer",
        "training/gradients.py:apply_gradients",
    } <= ran

    upstream_path = [
        c
        for c in calls
        if distributed not in c
        and c not in HOOK_FRAMES
        and not c.startswith("keras/src/backend/torch/distribution_lib.py")
    ]
    assert upstream_path == upstream_calls

    np.testing.assert_allclose(ours["losses"], upstream["losses"], rtol=1e-6)
    for mine, theirs in zip(ours["weights"], upstream["weights"]):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-7)
