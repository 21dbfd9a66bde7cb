"""Smoke run of benchmarks/bench_checkpoint.py: it runs and reports.

Tiny shapes and one round: checks that every operation is timed and
measured on every rank, never how fast or how small.
"""

import json
import re
from pathlib import Path

from tests.harness import run_torchrun

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
OPERATIONS = (
    "dcp_save",
    "dcp_save_background",
    "dcp_background_done",
    "dcp_load",
    "h5_save",
    "h5_load",
)


def test_bench_checkpoint_reports_every_operation(tmp_path):
    path = tmp_path / "checkpoint.json"
    result = run_torchrun(
        BENCHMARKS / "bench_checkpoint.py",
        2,
        ["--layers", "2", "--dim", "64", "--repeats", "1", "--json", path],
        timeout=300,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    data = json.loads(path.read_text())
    assert sorted(data["summary"]) == sorted(OPERATIONS)
    for op in OPERATIONS:
        summary = data["summary"][op]
        assert summary["median_s"] > 0
        assert len(summary["peak_increase"]) == 2
        assert re.search(rf"^{op}\s+\d+\.\d+\s+\d+\.\d+", result.stdout, re.M)
    for rank in data["ranks"]:
        # Two kernels of 64x64 float32 sharded over 2 ranks, two biases.
        assert rank["own_shards"] == 2 * (64 * 32 * 4) + 2 * 64 * 4
    assert "h5 / dcp save: time" in result.stdout
