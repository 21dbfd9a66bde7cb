"""examples/hello_distribution.py under torchrun; run_multi_gpu.sh's choices."""

import itertools
import os
import re
import shlex
import subprocess
from pathlib import Path

from tests.harness import run_torchrun

REPO = Path(__file__).resolve().parents[1]


def _cpu_env(**extra):
    # No GPU for the children, whatever the machine has: 2 CPU processes on
    # gloo everywhere, so the tests do not depend on the GPU count.
    return dict(
        os.environ, KERAS_BACKEND="torch", CUDA_VISIBLE_DEVICES="", **extra
    )


def test_hello_distribution_on_two_processes():
    # torchrun straight from this venv: run_multi_gpu.sh would bootstrap
    # again. No GPU for the ranks, as in `_cpu_env` (run_torchrun sets
    # KERAS_BACKEND=torch itself).
    result = run_torchrun(
        REPO / "examples" / "hello_distribution.py",
        nproc=2,
        timeout=120,
        env={"CUDA_VISIBLE_DEVICES": ""},
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ranks = re.findall(
        r"^process (\d) of 2 \(pid \d+\): devices \[.+\]$",
        result.stdout,
        re.MULTILINE,
    )
    assert sorted(ranks) == ["0", "1"], result.stdout + result.stderr


def _dry_run(*args, env=None):
    """Runs run_multi_gpu.sh in dry-run mode.

    Returns:
        `(torchrun's arguments, stderr)`; the variables set are checked.
    """
    env = env or _cpu_env(RUN_MULTI_GPU_DRY_RUN="1")
    result = subprocess.run(
        ["bash", str(REPO / "run_multi_gpu.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout)
    variables = list(itertools.takewhile(lambda a: "=" in a, argv))
    argv = argv[len(variables) :]
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    nproc = int(argv[argv.index("--nproc-per-node") + 1])
    # torchrun's default, set before torchrun warns that it sets it.
    expected = ["KERAS_BACKEND=torch"]
    if nproc > 1 and "OMP_NUM_THREADS" not in env:
        expected.append("OMP_NUM_THREADS=1")
    assert variables == expected
    return argv[3:], result.stderr


def test_no_gpu_runs_two_cpu_processes_on_gloo():
    argv, stderr = _dry_run("examples/hello_distribution.py", "--steps", "3")
    assert argv == [
        "--standalone",
        "--nproc-per-node",
        "2",
        "examples/hello_distribution.py",
        "--steps",
        "3",
    ]
    assert "no GPU" in stderr and "gloo" in stderr


def test_process_count_override():
    argv, _ = _dry_run("-n", "4", "train.py")
    assert argv == ["--standalone", "--nproc-per-node", "4", "train.py"]
    # One process keeps its OpenMP threads; a thread count set is kept.
    argv, _ = _dry_run("-n", "1", "train.py")
    assert argv == ["--standalone", "--nproc-per-node", "1", "train.py"]
    _dry_run(
        "train.py", env=_cpu_env(RUN_MULTI_GPU_DRY_RUN="1", OMP_NUM_THREADS="4")
    )


def test_multi_node_flags_pass_through():
    argv, _ = _dry_run(
        "--nnodes",
        "2",
        "--node-rank=1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "node0:29500",
        "--max-restarts",
        "3",
        "train.py",
        "--nnodes",
        "x",
    )
    assert argv == [
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "node0:29500",
        "--max-restarts",
        "3",
        "--nproc-per-node",
        "2",
        "train.py",
        "--nnodes",
        "x",
    ]


def test_one_process_per_gpu(tmp_path):
    # A stand-in nvidia-smi that lists 3 GPUs.
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        'for i in 0 1 2; do echo "GPU $i: Fake (UUID: GPU-$i)"; done\n'
    )
    fake.chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{tmp_path}:{os.environ['PATH']}",
        RUN_MULTI_GPU_DRY_RUN="1",
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    argv, stderr = _dry_run("train.py", env=env)
    assert argv == ["--standalone", "--nproc-per-node", "3", "train.py"]
    assert "gloo" not in stderr
    env["CUDA_VISIBLE_DEVICES"] = "0,2"
    argv, _ = _dry_run("train.py", env=env)
    assert argv == ["--standalone", "--nproc-per-node", "2", "train.py"]


def test_help_and_bad_usage():
    help_run = subprocess.run(
        ["bash", str(REPO / "run_multi_gpu.sh"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert help_run.returncode == 0 and "Usage" in help_run.stdout
    bad = subprocess.run(
        ["bash", str(REPO / "run_multi_gpu.sh"), "-n", "0", "x.py"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "positive integer" in bad.stderr
