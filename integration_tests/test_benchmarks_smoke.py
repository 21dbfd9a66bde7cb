"""Smoke runs of benchmarks/: they run under torchrun and print their results.

Tiny shapes and 1-2 timed steps: these tests check that the scripts work
and report what they should (the same work on every side, the counts, the
memory check and its failure path), never how fast anything is.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import run_torchrun

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "build_backend"))
import overlaylib  # noqa: E402

BENCHMARKS = REPO / "benchmarks"
# CPU processes on gloo whatever the machine has.
CPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}
TINY_STEP = [
    "--batch",
    "8",
    "--dim",
    "16",
    "--hidden",
    "32",
    "--seq-len",
    "2",
    "--heads",
    "2",
    "--rounds",
    "2",
    "--steps",
    "1",
    "--warmup",
    "1",
]
EAGER = ("keras_mp", "native_tp", "keras_dp", "native_ddp")
LOCAL = (
    "keras_local_tp",
    "native_local_tp",
    "keras_local_dp",
    "native_local_dp",
)
# Pristine Keras on the work of keras_local_dp (a worker process per rank).
UPSTREAM = ("upstream_local_dp",)
# Adam's scalar step counters are not in the ideal bytes.
SCALAR_SLACK_BYTES = 1024


@pytest.fixture(scope="module")
def pristine_root():
    version = overlaylib.upstream_version(
        overlaylib.project_table(REPO)["version"]
    )
    return overlaylib.pristine_upstream(version, REPO / "build" / "upstream")


def _step_results(tmp_path, *extra):
    """Runs bench_step.py on 2 ranks; returns (stdout, parsed JSON)."""
    path = tmp_path / "step.json"
    result = run_torchrun(
        BENCHMARKS / "bench_step.py",
        2,
        [*TINY_STEP, *extra, "--json", path],
        timeout=420,
        env=CPU_ENV,
    )
    return result.stdout, json.loads(path.read_text())


def test_bench_step_runs_all_implementations(tmp_path, pristine_root):
    text, data = _step_results(tmp_path, "--upstream-keras", str(pristine_root))
    assert "Machine: cpu=" in text and "world_size=2" in text, text
    results = {(r["model"], r["impl"]): r for r in data["results"]}
    assert set(results) == {
        (m, i) for m in ("mlp", "transformer") for i in EAGER + LOCAL + UPSTREAM
    }
    for (model, impl), r in results.items():
        assert re.search(
            rf"^{model}\s+{impl}\s+\d+\.\d+\s+\d+\.\d+", text, re.MULTILINE
        ), text
        assert len(r["times_ms"]) == 2 and min(r["times_ms"]) > 0
        if impl in UPSTREAM:
            # It ran pristine Keras, in its own process: not counted.
            assert r["collectives"] is None
            root = str(Path(pristine_root).resolve())
            assert any(root in n for n in r["notes"]), r
            continue
        # The optimizer update itself never communicates.
        assert r["collectives"]["optimizer_alone"] == 0, r
        assert r["state_bytes"] <= r["ideal_state_bytes"] + SCALAR_SLACK_BYTES
    # Native tensor parallelism reaches Megatron's count: the counting
    # works. DDP's bucket count comes from its comm hook.
    assert results[("mlp", "native_tp")]["collectives"]["total"] == 1
    assert results[("transformer", "native_tp")]["collectives"]["total"] == 4
    assert results[("mlp", "native_ddp")]["collectives"]["total"] == 1
    # Keras DataParallel too: the loss rides in the gradient bucket.
    for model in ("mlp", "transformer"):
        assert results[(model, "keras_dp")]["collectives"]["total"] == 1
    # A rank training its share alone does not communicate.
    for model in ("mlp", "transformer"):
        for impl in LOCAL:
            assert results[(model, impl)]["collectives"]["total"] == 0
    # Sharded state: the TP sides hold less than the data-parallel ones;
    # the TP floor trains one rank's share: its bytes are about the TP
    # side's (the replicated LayerNorms and biases held whole by both).
    for model in ("mlp", "transformer"):
        tp = results[(model, "keras_mp")]["state_bytes"]
        assert tp < results[(model, "keras_dp")]["state_bytes"]
        local_tp = results[(model, "keras_local_tp")]["state_bytes"]
        assert abs(local_tp - tp) <= SCALAR_SLACK_BYTES
        assert (
            results[(model, "keras_local_dp")]["state_bytes"]
            == (results[(model, "keras_dp")]["state_bytes"])
        )
    # The same work on both sides: the same first-step loss.
    assert {(p["keras"], p["native"]) for p in data["ratios"]} == {
        ("keras_mp", "native_tp"),
        ("keras_dp", "native_ddp"),
        ("keras_local_tp", "native_local_tp"),
        ("keras_local_dp", "native_local_dp"),
        ("keras_local_dp", "upstream_local_dp"),
    }
    for p in data["ratios"]:
        assert p["first_loss_rel_diff"] < 1e-4, p
        assert f"{p['keras']} / {p['native']}" in text


def _memory_run(*args):
    return run_torchrun(
        BENCHMARKS / "bench_memory.py",
        2,
        list(args),
        timeout=300,
        env=CPU_ENV,
        check=False,
    )


def _memory_rows(text):
    rows = re.findall(
        r"^\s+(\d)\s+(-?[\d.]+)\s+(-?[\d.]+)\s+([\d.]+)\s+([\d.]+)\s+"
        r"(-?[\d.]+)\s+(-?[\d.]+)\s+(ok|FAIL)",
        text,
        re.MULTILINE,
    )
    return {int(r[0]): r for r in rows}


def test_bench_memory_prints_the_check(tmp_path):
    # 4 kernels of 4 MiB: RSS noise is of that order, so only the numbers
    # the script computes itself are checked, and that it agrees with
    # its exit code.
    path = tmp_path / "memory.json"
    result = _memory_run("--layers", "4", "--dim", "1024", "--json", path)
    rows = _memory_rows(result.stdout)
    assert sorted(rows) == [0, 1], result.stdout + result.stderr
    data = json.loads(path.read_text())
    for r in data["ranks"]:
        kernels = 4 * 1024 * 1024 * 4 // 2
        biases = 4 * 1024 * 4
        assert r["own_shards"] == kernels + biases
        assert r["largest_variable"] == 1024 * 1024 * 4
        assert r["bound"] == r["own_shards"] + r["largest_variable"] + (
            64 * 1024 * 1024
        )
    verdicts = {row[-1] for row in rows.values()}
    assert result.returncode == (0 if verdicts == {"ok"} else 1)


def test_bench_memory_fails_above_the_bound():
    result = _memory_run(
        "--layers", "2", "--dim", "256", "--allowance-mib", "-100"
    )
    rows = _memory_rows(result.stdout)
    assert sorted(rows) == [0, 1], result.stdout + result.stderr
    assert all(row[-1] == "FAIL" for row in rows.values())
    assert result.returncode != 0


def test_bench_fsdp_compares_the_same_work(tmp_path):
    # bench_fsdp.py launches its own torchrun per implementation.
    path = tmp_path / "fsdp.json"
    # torch's FSDP2 (`native_fsdp2`) runs beside them by hand (see
    # benchmarks/README.md): a third torchrun here would cost CI 10 s for
    # code that is torch's.
    impls = ["keras_fsdp", "keras_fsdp_dtensor"]
    result = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "bench_fsdp.py"),
            "--procs=2",
            "--layers=2",
            "--dim=64",
            "--batch=8",
            "--steps=1",
            "--phases=memory",
            "--timeout=300",
            f"--json={path}",
            "--impls",
            *impls,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **CPU_ENV},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {r["impl"]: r for r in json.loads(path.read_text())["results"]}
    assert sorted(rows) == sorted(impls)
    # The Keras runs train the same model on the same data: one loss.
    keras_losses = {rows[i]["loss"] for i in impls if i.startswith("keras")}
    assert max(keras_losses) - min(keras_losses) < 1e-4 * max(keras_losses)
    for impl in impls:
        assert f"| 2 | {impl} |" in result.stdout
        assert rows[impl]["peak_mib"] > 0 and rows[impl]["ideal_mib"] > 0


def _run_script(name, arguments, timeout):
    """A benchmark run as a plain script (a driver, or one process) on
    CPU; its standard output."""
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *arguments],
        capture_output=True,
        text=True,
        env=dict(os.environ, **CPU_ENV, KERAS_BACKEND="torch"),
        timeout=timeout,
        check=True,
    ).stdout


def test_bench_weak_scaling_prints_both_sides_and_the_path():
    # A driver: one torchrun job per side and number of processes.
    out = _run_script(
        "bench_weak_scaling.py",
        [
            "--models",
            "mlp_own",
            "--procs",
            "2",
            "--rows",
            "4",
            "--steps",
            "2",
            "--floor",
            "--phases",
        ],
        timeout=600,
    )
    # A user's layer is per-sample: the local rows.
    assert "mlp_own (DataParallel path: local)" in out, out
    row = re.search(r"^\s+2\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", out, re.M)
    assert row is not None, out
    dp, ddp, ratio = map(float, row.groups())
    # The ratio of the unrounded times; each time printed to 0.05 ms.
    slack = ratio * (0.05 / dp + 0.05 / ddp) + 0.005
    assert dp > 0 and ddp > 0 and abs(ratio - dp / ddp) <= slack
    # The floor: Keras' own step over the loop's, added to DDP's step.
    floor = re.search(
        r"Keras ([\d.]+) ms, loop ([\d.]+) ms; floor ([\d.]+)", out
    )
    assert floor is not None, out
    keras_alone, loop_alone, printed = map(float, floor.groups())
    expected = (ddp + keras_alone - loop_alone) / ddp
    # Each time printed to 0.05 ms: Keras' and the loop's shift the floor
    # by up to 0.1 / ddp, DDP's by up to |Keras - loop| * 0.05 / ddp**2.
    slack = 0.1 / ddp + abs(keras_alone - loop_alone) * 0.05 / ddp**2
    assert abs(printed - expected) <= slack + 0.005, out
    # The train step's parts, timed on both sides; the DP side reduces.
    parts = dict(
        (label.strip(), (float(a), float(b)))
        for label, a, b in re.findall(
            r"^\s{6}([a-z][a-z ()_-]+?)\s+([\d.]+)\s+([\d.]+)$", out, re.M
        )
    )
    assert parts["train_step"][0] > 0 and parts["train_step"][1] > 0, out
    assert parts["gradients reduced"][1] > 0, out
    # The batch as DTensors, or cut to each process' rows (a step on plain
    # rows): the DP side's alone.
    labels = ("the batch distributed", "the batch cut to rows")
    batch = [parts[x] for x in labels if x in parts]
    assert batch and all(alone == 0 for alone, _ in batch), out
    assert any(dp > 0 for _, dp in batch), out


def test_bench_weak_scaling_interleaved_repeats_in_one_job_each():
    # The five sides in the same processes, one torchrun job a repeat.
    out = _run_script(
        "bench_weak_scaling.py",
        [
            "--models",
            "mlp",
            "--procs",
            "2",
            "--rows",
            "4",
            "--steps",
            "10",
            "--repeats",
            "2",
            "--interleaved",
        ],
        timeout=600,
    )
    assert "mlp (DataParallel path: local)" in out, out
    row = re.search(
        r"^\s+2\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) \(not measured", out, re.M
    )
    assert row is not None, out
    dp, ddp, ratio = map(float, row.groups())
    assert dp > 0 and ddp > 0 and ratio > 0, out
    # Each side's step in each job: the two jobs' ratios, and the floor.
    repeats = re.search(
        r"step ratio of each repeat: ([\d.]+), ([\d.]+)$", out, re.M
    )
    assert repeats is not None, out
    assert re.search(r"Keras [\d.]+ ms, loop [\d.]+ ms; floor", out), out
    # The fifth side: Keras' own step with its model called through DDP.
    step_ddp = re.search(
        r"called through DDP: ([\d.]+) ms; DataParallel / it ([\d.]+)$",
        out,
        re.M,
    )
    assert step_ddp is not None, out
    peer, against = map(float, step_ddp.groups())
    slack = against * (0.05 / dp + 0.05 / peer) + 0.005
    assert peer > 0 and abs(against - dp / peer) <= slack, out
    assert re.search(
        r"against Keras' step on DDP: ([\d.]+), ([\d.]+)$", out, re.M
    ), out


def _step_through_ddp_body(rank, world_size):
    """Each side's weights after 3 steps on this process' own rows, summed."""
    import numpy as np

    sys.path.insert(0, str(BENCHMARKS))
    import weak_scaling_models

    sums = {}
    for impl in ("keras_step_ddp", "keras_alone"):
        model, step = weak_scaling_models.make_step(
            impl, "mlp", 4, rank, world_size
        )
        for _ in range(3):
            step()
        sums[impl] = [float(np.sum(w)) for w in model.get_weights()]
    return sums


def test_keras_step_through_ddp_reduces_the_gradients():
    # The benchmark's peer trains each process on its own rows: only DDP's
    # reduction keeps the processes' weights equal (alone, they differ).
    from tests.harness import run_on_ranks

    first, second = run_on_ranks(_step_through_ddp_body, world_size=2)
    assert first["keras_step_ddp"] == second["keras_step_ddp"]
    assert first["keras_alone"] != second["keras_alone"]


def test_bench_step_parts_prints_each_freed_part_against_the_peer():
    result = run_torchrun(
        BENCHMARKS / "bench_step_parts.py",
        2,
        ["--model", "mlp", "--rows", "4", "--rounds", "1"]
        + ["--parts", "nothing", "generator_check"],
        timeout=300,
        env=CPU_ENV,
    )
    out = result.stdout
    peer = re.search(r"Keras' step on DDP: ([\d.]+) ms$", out, re.M)
    base = re.search(r"DataParallel: ([\d.]+) ms, ([\d.]+)x it$", out, re.M)
    assert peer is not None and base is not None, out
    peer_ms, (base_ms, ratio) = float(peer[1]), map(float, base.groups())
    assert peer_ms > 0 and abs(ratio - base_ms / peer_ms) <= 0.001 + (
        ratio * 0.0005 * (1 / base_ms + 1 / peer_ms)
    ), out
    for part in ("nothing", "generator_check"):
        freed = re.search(
            rf"{part} freed: ([\d.]+) ms, [\d.]+x; saves (-?\d+) us", out
        )
        assert freed is not None, out
        saved = (base_ms - float(freed[1])) * 1e3
        assert abs(saved - int(freed[2])) <= 1.5, out
    # The freed parts left the model on its local rows.
    assert "still on the local rows after all: True" in out, out


def test_a_freed_part_is_restored_after_its_block():
    import random

    sys.path.insert(0, str(BENCHMARKS))
    import bench_step_parts

    from keras.src.backend.torch.distributed.core import generator_states

    take, advanced = generator_states.take, generator_states.advanced
    with bench_step_parts.freed("generator_check"):
        assert generator_states.take is not take
        assert generator_states.advanced(generator_states.take()) is False
    assert generator_states.take is take
    assert generator_states.advanced is advanced
    # Restored also when the block raises.
    with pytest.raises(RuntimeError), bench_step_parts.freed("python_state"):
        assert generator_states.random is not random
        raise RuntimeError("left by an error")
    assert generator_states.random is random


def test_bench_call_agreement_prints_the_step_and_read_costs():
    result = run_torchrun(
        BENCHMARKS / "bench_call_agreement.py",
        2,
        ["--dim", "16", "--rounds", "1", "--steps", "2", "--reads", "2"],
        timeout=300,
        env=CPU_ENV,
    )
    for line in (
        "processes: 2",
        "train step, watcher running:",
        "train step, watcher stopped:",
        "read: Keras (announced)",
        "read: full_tensor()",
    ):
        assert line in result.stdout, result.stdout


def test_bench_random_draws_prints_each_draw_against_torch():
    out = _run_script(
        "bench_random_draws.py",
        ["--sizes", "1000", "--rounds", "1", "--repeats", "2"],
        timeout=300,
    )
    for name in ("dropout", "uniform", "normal"):
        match = re.search(
            rf"^{name} 1000: by position ([\d.]+) ms, torch ([\d.]+) ms, "
            r"ratio ([\d.]+)x$",
            out,
            re.M,
        )
        assert match is not None, out
        assert float(match.group(1)) > 0 and float(match.group(2)) > 0


def test_bench_job_failures_names_the_failed_process():
    out = _run_script(
        "bench_job_failures.py",
        ["--scenarios", "raise", "--launches", "one_node", "--timeout", "30"],
        timeout=300,
    )
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[4:7]]
        for line in out.splitlines()
        if line.startswith("| torch_") or line.startswith("| keras_")
    }
    assert sorted(rows) == ["keras_data_parallel", "torch_ddp_record"], out
    seconds, names, shows = rows["keras_data_parallel"]
    assert float(seconds) > 0 and (names, shows) == ("1/1", "1/1"), out


def test_bench_collective_latency_prints_each_work_and_launch():
    result = run_torchrun(
        BENCHMARKS / "bench_collective_latency.py",
        2,
        ["--work-ms", "0", "1", "--repeats", "3"],
        timeout=120,
        env=CPU_ENV,
    )
    rows = re.findall(
        r"^\s*([\d.]+)\s+(sync|async)\s+([\d.]+)\s+([\d.]+)$",
        result.stdout,
        re.M,
    )
    assert [(w, launch) for w, launch, _, _ in rows] == [
        ("0", "sync"),
        ("0", "async"),
        ("1", "sync"),
        ("1", "async"),
    ], result.stdout
    assert all(float(m) > 0 and float(p) >= float(m) for *_, m, p in rows)
