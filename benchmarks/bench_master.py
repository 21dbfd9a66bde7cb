"""Keras master's own torch distribution against ours, on our scenarios.

Trains the small models of `tests/parity_models.py` (those of the
held-out-style parity tests, `tests/test_training_parity.py`) under a
`keras.distribution`, in 2 processes (4 for the 2x2 mesh) on gloo, each
with one CPU thread, in two interpreters:

- `--master`: pristine Keras master (`keras-nightly`), its own torch
  `distribution_lib` (DDP under `DataParallel`, DTensor under
  `ModelParallel`);
- `--ours`: this package built on the same nightly (`.venv-nightly`).

Each is compared with one process without a distribution in the same
interpreter: the per-epoch losses, the final weights and optimizer state
(max relative difference: the largest `max|a - b| / max|b|` over the
arrays, `max|b|` floored at 0.01, see `SCALE_FLOOR`), and `predict`. The
step time is the median of a fit's steps but the first two, on process 0
(`on_train_batch_begin` to `_end`); `--repeat` runs each scenario again
and takes the median of the runs' medians (the machine may be shared).

    python3 -m venv build/pristine-nightly
    build/pristine-nightly/bin/python -m pip install -c constraints/ci.txt \\
        torch keras-nightly==3.16.0.dev2026102704
    python benchmarks/bench_master.py \\
        --master build/pristine-nightly/bin/python \\
        --ours .venv-nightly/bin/python --json build/bench_master.json

Both run the same script: global batches of `--batch` rows, unshuffled,
of which each process is given its own rows (`auto_shard_dataset=False`,
the rows of `tests.parity_models.local_rows`, `batch_size` the global batch
over the mesh's batch axis): under a multi-process distribution Keras
master refuses NumPy arrays with `auto_shard_dataset=True` (only
`tf.data` and `PyDataset` there), which ours takes as global batches. The
reference (one process) takes the whole arrays in batches of `--batch`.
`predict` is compared with the reference's rows that the process was
given, or with all of them where it returns the global result.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {"dp": 2, "mp": 2, "2x2": 4}
KINDS = ("mlp", "attention")
# Equal to one process: within the parity tests' tolerances
# (`tests.parity_models` RTOL, ATOL), `|a - b| <= ATOL + RTOL |b|`, which
# `max|a - b| / max(max|b|, ATOL / RTOL) <= RTOL` gives within a factor of
# 2: the scale of an array whose values are all ~0 (attention's key bias,
# whose gradient is float noise: values ~1e-10) is floored at ATOL / RTOL.
EQUAL_RTOL = 1e-4
SCALE_FLOOR = 1e-6 / EQUAL_RTOL


def _worker(args):
    """One process of a run: fits, writes its result as JSON."""
    import torch

    torch.set_num_threads(1)
    import keras

    # Appended after keras is imported: the repository's own `keras/`
    # (our overlay's sources) must not shadow the installed package.
    sys.path.append(str(REPO))
    from tests import distributions
    from tests import parity_models as pm

    rank = int(os.environ.get("RANK", 0))
    result = {"rank": rank}
    try:
        if args.setting != "single":
            keras.distribution.initialize()
        distributions.use_setting(
            args.setting,
            layout_rules=pm.LAYOUT_RULES[args.kind],
            auto_shard_dataset=False,
        )
        model = pm.build_model(args.kind)
        x, y = pm.make_data(args.kind, num_samples=args.samples)
        part, parts = pm.batch_part(
            args.setting,
            rank=rank,
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
        )
        x, y = [
            pm.local_rows(a, batch_size=args.batch, part=part, num_parts=parts)
            for a in (x, y)
        ]
        batch_size = args.batch // parts
        result["part"] = [part, parts]
        timer = _step_timer(keras)
        history = model.fit(
            x,
            y,
            batch_size=batch_size,
            epochs=args.epochs,
            shuffle=False,
            verbose=0,
            callbacks=[timer],
        )
        result["batch"] = args.batch
        result["loss"] = [float(v) for v in history.history["loss"]]
        result["state"] = {
            k: np.asarray(v).tolist() for k, v in pm.model_state(model).items()
        }
        result["step_s"] = statistics.median(timer.times[2:])
        result["steps"] = len(timer.times)
        predicted = model.predict(x, batch_size=batch_size, verbose=0)
        result["predict"] = np.asarray(predicted).tolist()
    except Exception as e:  # Reported in the table.
        message = str(e).strip().splitlines()
        result["error"] = f"{type(e).__name__}: {message[0] if message else ''}"
    with open(f"{args.out}.{rank}", "w") as f:
        json.dump(result, f)
    if args.setting != "single":
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _step_timer(keras):
    """A Keras callback that times each train step (`.times`, seconds)."""

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []
            self._start = None

        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self._start)

    return StepTimer()


def _run(python, impl, setting, kind, args, workdir):
    """Runs one scenario; returns the results of its processes by rank."""
    out = Path(workdir) / f"{impl}-{setting}-{kind}.json"
    worker = [
        str(Path(__file__).resolve()),
        "--worker",
        f"--impl={impl}",
        f"--setting={setting}",
        f"--kind={kind}",
        f"--batch={args.batch}",
        f"--samples={args.samples}",
        f"--epochs={args.epochs}",
        f"--out={out}",
    ]
    processes = SETTINGS.get(setting, 1)
    if setting == "single":
        command = [python] + worker
    else:
        command = [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={processes}",
        ] + worker
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command,
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        Path(f"{out}.stderr").write_text(done.stderr)
        failure = None
        if done.returncode != 0:
            failure = f"exit {done.returncode}: " + _last_error(done.stderr)
    except subprocess.TimeoutExpired:
        failure = f"timed out after {args.timeout} s"
    wall = time.perf_counter() - start
    results = []
    for rank in range(processes):
        path = Path(f"{out}.{rank}")
        if path.exists():
            results.append(json.loads(path.read_text()))
    return results, failure, wall


def _last_error(stderr):
    """The last line of a traceback that names an error."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line[:200]
    return lines[-1][:200] if lines else ""


def _max_rel_diff(actual, expected):
    """Largest relative difference of pairs of arrays (`_rel_diffs`)."""
    return max(_rel_diffs(actual, expected), default=0.0)


def _rel_diffs(actual, expected):
    """`max|a - b| / max(max|b|, SCALE_FLOOR)` of each pair of arrays."""
    diffs = []
    for a, b in zip(actual, expected):
        a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
        if a.shape != b.shape:
            diffs.append(float("inf"))
        elif a.size:
            scale = max(float(np.abs(b).max()), SCALE_FLOOR)
            diffs.append(float(np.abs(a - b).max()) / scale)
    return diffs


def _compare(results, failure, reference):
    """A table row's cells: equal to one process?, step time, error."""
    first = results[0] if results else {}
    errors = sorted({r["error"] for r in results if "error" in r})
    error = "; ".join(errors) or failure
    if "loss" not in first:
        return {"error": error or "no result"}
    keys = sorted(reference["state"])
    row = {"step_ms": 1e3 * first["step_s"], "error": error}
    if sorted(first["state"]) != keys:
        row["state_rel"] = float("inf")
        row["note"] = "other variables than one process'"
    else:
        diffs = _rel_diffs(
            [first["state"][k] for k in keys],
            [reference["state"][k] for k in keys],
        )
        row["state_rel"] = max(diffs)
        row["worst"] = keys[int(np.argmax(diffs))]
    row["loss_rel"] = _max_rel_diff([first["loss"]], [reference["loss"]])
    predicted = first.get("predict", [])
    expected = np.asarray(reference["predict"])
    if len(predicted) != len(expected):
        part, parts = first["part"]
        expected = _rows(expected, part, parts, reference["batch"])
    row["predict_rel"] = _max_rel_diff([predicted], [expected])
    row["predict_rows"] = len(predicted)
    # Do the processes hold the same weights?
    row["ranks_rel"] = max(
        (
            _max_rel_diff(
                [r["state"][k] for k in keys], [first["state"][k] for k in keys]
            )
            for r in results[1:]
            if "state" in r and sorted(r["state"]) == keys
        ),
        default=0.0,
    )
    return row


def _median_row(rows):
    """The first complete run's row, with the median step time of the
    complete runs, and how many runs crashed."""
    complete = [r for r in rows if "step_ms" in r]
    crashed = [r for r in rows if "step_ms" not in r]
    row = dict(complete[0] if complete else rows[0])
    if complete:
        row["step_ms"] = statistics.median(r["step_ms"] for r in complete)
        row["step_ms_runs"] = [r["step_ms"] for r in complete]
    if complete and crashed:
        row["crashes"] = f"{len(crashed)} of {len(rows)} runs: "
        row["crashes"] += crashed[0].get("error") or "no result"
    return row


def _rows(array, part, parts, batch):
    """Part `part` of `parts` of each global batch of `array`."""
    sys.path.append(str(REPO))
    from tests import parity_models as pm

    return pm.local_rows(array, batch_size=batch, part=part, num_parts=parts)


def _cell(row):
    if "loss_rel" not in row:
        return f"crash: {row['error']}"
    rel = max(row["loss_rel"], row["state_rel"])
    equal = "yes" if rel <= EQUAL_RTOL else "**no**"
    text = f"{equal} ({rel:.1e}), {row['step_ms']:.1f} ms"
    if row["predict_rel"] > EQUAL_RTOL:
        text += f"; predict differs ({row['predict_rows']} rows)"
    if row["ranks_rel"] > EQUAL_RTOL:
        text += f"; ranks differ ({row['ranks_rel']:.1e})"
    if row.get("error"):
        text += f"; error: {row['error']}"
    if row.get("crashes"):
        text += f"; crashed in {row['crashes']}"
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--impl", choices=("master", "ours"))
    parser.add_argument("--setting", default="single")
    parser.add_argument("--kind", default="mlp")
    parser.add_argument("--out")
    parser.add_argument("--master", help="python of pristine keras-nightly")
    parser.add_argument("--ours", help="python of ours on keras-nightly")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--json", help="write every row here too")
    parser.add_argument("--keep", help="keep each process' results here")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    unknown = sorted(set(args.settings.split(",")) - set(SETTINGS))
    if unknown:
        parser.error(
            f"--settings: unknown {unknown}; choose among {sorted(SETTINGS)} "
            "(the one-process reference always runs)"
        )
    impls = {"master": args.master, "ours": args.ours}
    # Not resolved: a venv's python is a link out of the venv.
    impls = {k: os.path.abspath(v) for k, v in impls.items() if v}
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    kept = contextlib.nullcontext(os.path.abspath(args.keep or "."))
    runs = {}
    references = {}
    with kept if args.keep else tempfile.TemporaryDirectory() as workdir:
        # Repeats go round all scenarios, so that a change of the machine's
        # load falls on master and ours alike.
        for _ in range(args.repeat):
            for kind in args.kinds.split(","):
                for impl, python in impls.items():
                    single, failure, _ = _run(
                        python, impl, "single", kind, args, workdir
                    )
                    if not single or "loss" not in single[0]:
                        sys.exit(f"{impl} {kind}: one process: {failure}")
                    reference = references.setdefault((kind, impl), single[0])
                    runs.setdefault((kind, "single", impl), []).append(
                        {"step_ms": 1e3 * single[0]["step_s"]}
                    )
                    for setting in args.settings.split(","):
                        results, failure, wall = _run(
                            python, impl, setting, kind, args, workdir
                        )
                        row = _compare(results, failure, reference)
                        row["wall_s"] = wall
                        runs.setdefault((kind, setting, impl), []).append(row)
                        print(kind, setting, impl, row, file=sys.stderr)
    rows = {key: _median_row(value) for key, value in runs.items()}
    print("| scenario | " + " | ".join(impls) + " |")
    print("| --- |" + " --- |" * len(impls))
    for kind in args.kinds.split(","):
        cells = [
            f"{rows[(kind, 'single', i)]['step_ms']:.1f} ms" for i in impls
        ]
        print(f"| {kind}, one process | " + " | ".join(cells) + " |")
        for setting in args.settings.split(","):
            cells = [_cell(rows[(kind, setting, i)]) for i in impls]
            processes = SETTINGS[setting]
            print(
                f"| {kind}, {setting} ({processes} processes) | "
                + " | ".join(cells)
                + " |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({" ".join(k): v for k, v in rows.items()}, f, indent=1)


if __name__ == "__main__":
    main()
