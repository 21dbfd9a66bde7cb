"""A job that loses a process mid-epoch resumes and loses nothing.

Under `torchrun --max-restarts=1`, with `BackupAndRestore`: process 1 is
killed in the middle of an epoch, torchrun restarts both processes, and the
job resumes from the last backup. Its final weights and per-epoch losses
must equal those of the same job run without interruption. Both jobs run
at once (2 processes each).
"""

import concurrent.futures
import json
import os

import numpy as np

from tests.harness import run_torchrun

SCRIPT = os.path.join(os.path.dirname(__file__), "resume_scenario.py")
# Two jobs of 2 processes at once, one started twice, on a loaded machine.
TIMEOUT = 240


def _run(tmp_path, name, kill):
    out = str(tmp_path / f"{name}.npz")
    result = run_torchrun(
        SCRIPT,
        nproc=2,
        args=[str(tmp_path / f"{name}-backup"), out, kill],
        timeout=TIMEOUT,
        env={"KERAS_DISTRIBUTION_TIMEOUT": "30"},
        torchrun_args=["--max-restarts=1", "--monitor-interval=0.5"],
    )
    with open(out + ".losses.json") as f:
        losses = json.load(f)
    weights = np.load(out)
    return result, losses, [weights[k] for k in sorted(weights.files)]


def test_a_killed_process_resumes_from_the_backup_and_loses_nothing(
    tmp_path,
):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        interrupted = pool.submit(_run, tmp_path, "interrupted", "1")
        reference = pool.submit(_run, tmp_path, "reference", "0")
        result, losses, weights = interrupted.result()
        _, reference_losses, reference_weights = reference.result()
    # The job was restarted: the first attempt lost a process.
    output = result.stdout + result.stderr
    assert "exitcode: -9" in output, output[-3000:]
    assert sorted(losses) == sorted(reference_losses) == ["0", "1", "2", "3"]
    for epoch in reference_losses:
        np.testing.assert_allclose(
            losses[epoch], reference_losses[epoch], rtol=1e-6, err_msg=epoch
        )
    assert len(weights) == len(reference_weights)
    for value, expected in zip(weights, reference_weights):
        np.testing.assert_allclose(value, expected, rtol=1e-6, atol=1e-7)
