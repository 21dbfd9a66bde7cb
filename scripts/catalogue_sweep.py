"""Sweeps the `keras.layers` catalogue over every distribution; prints a table.

Runs every case of `tests/layer_catalogue.py` in one process with pristine
Keras 3.15.1 (the reference), then under each distributed run (DataParallel
on 2 and 4 processes, ModelParallel with the last or the first divisible
dimension of every variable sharded, FSDP-style, and a 2x2 mesh), and
prints, per run, how many cases equal one process and the failing cases
grouped by the kind of their failure. `tests/test_layer_catalogue.py` with
`KERAS_CATALOGUE_FULL=1` checks the same, case by case, against its table
of known failures.

    scripts/catalogue_sweep.sh                    # everything (~20 min)
    scripts/catalogue_sweep.sh --runs dp2 2x2 --cases Dense Conv2D
    scripts/catalogue_sweep.sh --known-failures   # also prints the table

`catalogue_sweep.sh` sets up the venv first (`scripts/bootstrap.sh`), so
`KERAS_VENV` and `KERAS_TORCH_CONSTRAINTS` pick another torch, e.g.
`KERAS_VENV=.venv-torch-new KERAS_TORCH_CONSTRAINTS=constraints/x.txt`.
"""

import argparse
import collections
import json
import os
import sys
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import layer_catalogue as lc  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs",
        nargs="+",
        default=list(lc.RUNS),
        choices=list(lc.RUNS),
        help="the distributed runs (default: all)",
    )
    parser.add_argument(
        "--cases", nargs="+", default=None, help="case names (default: all)"
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=lc.NUM_SAMPLES,
        help="samples per epoch, in batches of 8 (default %(default)s: a "
        "ragged last batch of 7; 24 gives even batches)",
    )
    parser.add_argument(
        "--json", help="also write the kinds of every failure to this file"
    )
    parser.add_argument(
        "--known-failures",
        action="store_true",
        help="also print the failures as `_KNOWN_FAILURES` of the test",
    )
    args = parser.parse_args(argv)
    names = args.cases or list(lc.CASES)
    unknown = sorted(set(names) - set(lc.CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}")

    import torch

    print(
        f"torch {torch.__version__}; {len(names)} cases; "
        f"{args.samples} samples",
        flush=True,
    )
    start = time.monotonic()
    reference = lc.full_reference(names, num_samples=args.samples)["results"]
    seconds = {"reference": time.monotonic() - start}
    print(
        "reference (one process: pristine Keras; random cases: this build "
        "under DataParallel): "
        f"{seconds['reference']:.0f} s",
        flush=True,
    )
    broken = {n: r["error"] for n, r in reference.items() if "error" in r}
    if broken:
        print(f"the reference itself failed: {broken}")

    kinds = {}
    for run in args.runs:
        mode, world_size = lc.RUNS[run]
        start = time.monotonic()
        results = lc.run_mode(
            mode, world_size, names, num_samples=args.samples, log=print
        )
        seconds[run] = time.monotonic() - start
        kinds[run] = {
            name: lc.failure_kind(results[name], reference[name])
            for name in names
        }
        failing = sum(kind is not None for kind in kinds[run].values())
        print(
            f"{run}: {len(names) - failing}/{len(names)} equal one process "
            f"({seconds[run]:.0f} s)",
            flush=True,
        )

    print()
    print(_table(kinds, seconds, len(names)))
    if args.known_failures:
        print()
        print(_known_failures(kinds))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"seconds": seconds, "kinds": kinds}, file, indent=1)
    return 0


def _table(kinds, seconds, total):
    """The sweep as text: a row per run, then its failures by kind."""
    lines = [
        "| run | processes | equal to one process | seconds |",
        "|---|---|---|---|",
    ]
    for run, by_case in kinds.items():
        passing = sum(kind is None for kind in by_case.values())
        lines.append(
            f"| {run} | {lc.RUNS[run][1]} | {passing}/{total} | "
            f"{seconds[run]:.0f} |"
        )
    for run, by_case in kinds.items():
        groups = collections.defaultdict(list)
        for name, kind in by_case.items():
            if kind is not None:
                groups[kind].append(name)
        lines.append(f"\n{run}: failing cases by kind")
        for kind, cases in sorted(groups.items(), key=lambda g: -len(g[1])):
            lines.append(f"  [{len(cases)}] {kind}")
            lines.append(f"      {' '.join(cases)}")
    return "\n".join(lines)


def _known_failures(kinds):
    """The failures as the `_KNOWN_FAILURES` literal of the test.

    Each kind is cut to its first words (the test matches the start of a
    case's failure kind), and the runs with the same failing cases share
    one entry.
    """
    by_kind = collections.defaultdict(lambda: collections.defaultdict(list))
    for run, by_case in kinds.items():
        for name, kind in by_case.items():
            if kind is not None:
                by_kind[_short(kind)][run].append(name)
    lines = ["_KNOWN_FAILURES = {"]
    for kind, runs in by_kind.items():
        lines.append(f"    {kind!r}: {{")
        by_cases = collections.defaultdict(list)
        for run, cases in runs.items():
            by_cases[" ".join(cases)].append(run)
        for cases, same_runs in by_cases.items():
            wrapped = textwrap.wrap(cases, 60)
            lines.append(f"        {' '.join(same_runs)!r}: (")
            lines += [f"            {line + ' '!r}" for line in wrapped[:-1]]
            lines.append(f"            {wrapped[-1]!r}")
            lines.append("        ),")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def _short(kind, width=64):
    """`kind` cut after a word, at most `width` characters."""
    if len(kind) <= width:
        return kind
    return kind[:width].rsplit(" ", 1)[0]


if __name__ == "__main__":
    sys.exit(main())
