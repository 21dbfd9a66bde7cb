"""A `PyDataset` read by workers trains as with pristine Keras in one process.

With `workers > 1` (or `use_multiprocessing`) pristine Keras reads a
`PyDataset` through its `OrderedEnqueuer`, whose queue reads ahead and is
carried over `on_epoch_end`: the first batches of an epoch are those read
ahead in the last one, before the dataset changed at that epoch's end.
The distributed run must consume the same batches in the same order; its
losses and weights are compared with pristine Keras of the installed
package's base (3.15.1, or the Keras master nightly, which shuffles each
epoch with a seed of its own) run in a fresh interpreter
(`tests/pydataset_scenario.py`).
"""

import functools
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import distributions
from tests import parity_models as pm
from tests import pydataset_scenario
from tests.harness import run_on_ranks

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "build_backend"))
import overlaylib  # noqa: E402

BASE = overlaylib.base_of(REPO, importlib.metadata.version("keras"))


@functools.cache
def _pristine_result(arguments):
    """The scenario's result with pristine Keras, in a fresh interpreter.

    Args:
        arguments: the arguments of `pydataset_scenario.fit`, as JSON.
    """
    root = overlaylib.pristine_upstream(
        BASE.version, REPO / "build" / "upstream", BASE.distribution
    )
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(root)
    script = Path(pydataset_scenario.__file__)
    result = subprocess.run(
        [sys.executable, str(script), arguments],
        env=env,
        # Not the repository root, whose `keras/` would shadow pristine's.
        cwd="/",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, result.stdout[-2000:]
    return json.loads(line[-1][len("RESULT ") :])


def _fit_body(rank, world_size, setting, arguments):
    import multiprocessing

    distributions.use_setting(
        setting, layout_rules=pydataset_scenario.LAYOUT_RULES
    )
    # Keras' pool of reading processes forks, as under torchrun (Linux'
    # default); the harness' ranks default to its forkserver.
    default = multiprocessing.get_start_method()
    multiprocessing.set_start_method("fork", force=True)
    try:
        return pydataset_scenario.fit(**arguments)
    finally:
        multiprocessing.set_start_method(default, force=True)


# (setting, processes, arguments of `pydataset_scenario.fit`). Pristine
# Keras gives the same numbers run after run where each epoch takes some
# batches its enqueuer reads after `on_epoch_begin`: with `steps_per_epoch`
# shorter than the 11 batches a queue of 10 keeps at an epoch's end, what
# it keeps next depends on how far its thread got (a small queue here).
CASES = {
    "dp2": ("dp", 2, {"workers": 2}),
    "dp4-steps": (
        "dp",
        4,
        {"workers": 2, "max_queue_size": 2, "steps_per_epoch": 5},
    ),
    "2x2": ("2x2", 4, {"workers": 2}),
    "2x2-processes": ("2x2", 4, {"workers": 2, "use_multiprocessing": True}),
}


@pytest.mark.parametrize("case", CASES)
def test_pydataset_with_workers_trains_as_pristine_keras(case):
    setting, world_size, arguments = CASES[case]
    expected = _pristine_result(json.dumps(arguments, sort_keys=True))
    per_rank = run_on_ranks(
        _fit_body, world_size=world_size, args=(setting, arguments)
    )
    for rank, result in enumerate(per_rank):
        pm.assert_close(result, expected, f"rank {rank}")
