"""Upstream Keras' own tests of the files we change, run for torch.

The Keras 3.15.1 wheel ships its `*_test.py` files. An upstream reviewer of
this change would run those of the files our diffs touch; here they run
against the installed package and against pristine Keras 3.15.1 (the
downloaded wheel, first on `PYTHONPATH`), in one process each, with
`tests/upstream/conftest.py` standing in for the conftest of Keras'
repository. Some upstream tests fail on pristine Keras too on this machine
(e.g. dtype tests that need JAX): every test that passes on pristine Keras
must pass on ours.
"""

import concurrent.futures
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import keras

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "build_backend"))
import overlaylib  # noqa: E402

# Upstream test files of the upstream files our diffs change.
UPSTREAM_TEST_FILES = (
    "keras/src/backend/common/variables_test.py",  # torch core.py
    "keras/src/layers/layer_test.py",  # torch layer.py
    "keras/src/layers/convolutional/conv_test.py",  # torch nn.py
    "keras/src/random/random_test.py",  # torch random.py
    "keras/src/optimizers/adam_test.py",  # torch_adam.py
    "keras/src/optimizers/optimizer_test.py",  # torch_optimizer.py
    "keras/src/utils/torch_utils_test.py",
    "keras/src/utils/io_utils_test.py",
    "keras/src/callbacks/callback_test.py",  # callback_list.py
    "keras/src/callbacks/backup_and_restore_test.py",
    "keras/src/saving/saving_api_test.py",
    # torch trainer.py (trainer_test.py needs JAX, the adapters' tests TF).
    "keras/src/models/model_test.py",
    "keras/src/models/sequential_test.py",
    # Not epoch_iterator_test.py (epoch_iterator.py): it imports TF.
)
# Dtype-promotion tests compare with JAX, which this environment lacks: they
# fail on pristine Keras as on ours, and take a minute to.
DESELECT = "not DTypeTest"
TIMEOUT = 900


def _run_upstream_tests(root, pythonpath, junit):
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    files = [str(Path(root) / f) for f in UPSTREAM_TEST_FILES]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["-p", "conftest", "-c", os.devnull, "--rootdir", str(root)]
        + ["-k", DESELECT, f"--junitxml={junit}", *files],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert Path(junit).exists(), result.stdout[-3000:] + result.stderr[-3000:]
    outcomes, failures = {}, {}
    for case in ElementTree.parse(junit).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        failure = case.find("failure")
        failure = case.find("error") if failure is None else failure
        skipped = case.find("skipped") is not None
        if failure is not None:
            text = failure.text or failure.get("message", "")
            failures[name] = text[-1500:]
        outcomes[name] = (
            "failed" if failure is not None else "skipped" if skipped else "ok"
        )
    return outcomes, failures


def test_upstream_tests_of_changed_files_pass_as_on_pristine_keras(tmp_path):
    shim = REPO / "tests" / "upstream"
    installed = Path(keras.__file__).resolve().parents[1]
    pristine = overlaylib.pristine_upstream(
        overlaylib.upstream_version(overlaylib.project_table(REPO)["version"]),
        REPO / "build" / "upstream",
    )
    # Both at once: each is one single-threaded process.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ours = pool.submit(
            _run_upstream_tests, installed, [shim], tmp_path / "ours.xml"
        )
        theirs = pool.submit(
            _run_upstream_tests,
            pristine,
            [pristine, shim],
            tmp_path / "pristine.xml",
        )
        (ours, failures), (theirs, _) = ours.result(), theirs.result()
    passing_upstream = {t for t, o in theirs.items() if o == "ok"}
    assert len(passing_upstream) > 300, "upstream's tests did not run"
    assert set(ours) == set(theirs)
    broken = sorted(t for t in passing_upstream if ours[t] != "ok")
    assert not broken, f"{len(broken)} upstream tests broken:\n" + "\n".join(
        f"{t}:\n{failures.get(t, ours[t])}" for t in broken[:5]
    )
