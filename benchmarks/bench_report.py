"""The results: per-runner summaries, Keras / native ratios, the text rank 0
prints and the `--json` file."""

import dataclasses
import json
import statistics

from bench_counting import MIB
from bench_runner import PAIRS


def summarize(runner):
    """JSON-able results of one runner."""
    ms = [t * 1e3 for t in runner.times]
    cpu_ms = [t * 1e3 for t in runner.cpu_times]
    return {
        "model": runner.model,
        "impl": runner.impl,
        "median_ms": statistics.median(ms),
        "min_ms": min(ms),
        "median_cpu_ms": statistics.median(cpu_ms),
        "steps_timed": len(ms),
        "collectives": runner.collectives,
        "ideal_collectives": runner.ideal_collectives,
        "state_bytes": runner.bytes,
        "ideal_state_bytes": runner.ideal_bytes,
        "first_loss": runner.first_loss,
        "notes": runner.notes,
        "times_ms": ms,
        "cpu_times_ms": cpu_ms,
    }


def ratios(results):
    """Keras / native median and min ratios per model and pair."""
    by_name = {(r["model"], r["impl"]): r for r in results}
    out = []
    models = dict.fromkeys(r["model"] for r in results)
    for model in models:
        for impl, other in PAIRS:
            r = by_name.get((model, impl))
            native = by_name.get((model, other))
            if r is not None and native is not None:
                out.append(_ratio(model, impl, r, native))
    return out


def _ratio(model, impl, r, native):
    return {
        "model": model,
        "keras": impl,
        "native": native["impl"],
        "median_ratio": r["median_ms"] / native["median_ms"],
        "min_ratio": r["min_ms"] / native["min_ms"],
        "cpu_ratio": r["median_cpu_ms"] / native["median_cpu_ms"],
        "first_loss_rel_diff": abs(r["first_loss"] - native["first_loss"])
        / max(abs(native["first_loss"]), 1e-12),
    }


def format_report(info, args, results, pair_ratios):
    """The text rank 0 prints."""
    lines = _table(info, args, results)
    lines += _ratio_lines(pair_ratios)
    lines += _collective_lines(results)
    notes = [
        f"  {r['model']}/{r['impl']}: {n}" for r in results for n in r["notes"]
    ]
    if notes:
        lines += ["", "Notes:"] + notes
    return "\n".join(lines)


def write_json(path, info, args, results, pair_ratios):
    """Writes everything, per-step times included, to `path`."""
    with open(path, "w") as f:
        json.dump(
            {
                "machine": info,
                "args": {k: v for k, v in vars(args).items() if k != "shapes"},
                "shapes": dataclasses.asdict(args.shapes),
                "results": results,
                "ratios": pair_ratios,
            },
            f,
            indent=1,
        )


def _table(info, args, results):
    """The machine, the shapes and one row per runner."""
    s = args.shapes
    lines = [
        "Machine: " + ", ".join(f"{k}={v}" for k, v in info.items()),
        f"Shapes: global batch {s.batch}, D {s.dim}, H {s.hidden}, "
        f"transformer seq_len {s.seq_len}, heads {s.heads}; "
        f"{args.rounds} rounds x {args.steps} steps timed, "
        f"{args.warmup} warm-up steps",
        "",
        f"{'model':<12}{'impl':<20}{'median ms':>10}{'min ms':>9}"
        f"{'cpu ms':>9}"
        f"{'colls/step':>11}{'ideal':>6}{'opt-only':>9}"
        f"{'MiB/rank':>10}{'ideal':>8}{'loss@1':>10}",
    ]
    for r in results:
        c = r["collectives"] or {}
        lines.append(
            f"{r['model']:<12}{r['impl']:<20}{r['median_ms']:>10.2f}"
            f"{r['min_ms']:>9.2f}{r['median_cpu_ms']:>9.2f}"
            f"{_fmt(c.get('total')):>11}"
            f"{r['ideal_collectives']:>6}{_fmt(c.get('optimizer_alone')):>9}"
            f"{r['state_bytes'] / MIB:>10.2f}"
            f"{r['ideal_state_bytes'] / MIB:>8.2f}{r['first_loss']:>10.5f}"
        )
    return lines


def _ratio_lines(pair_ratios):
    lines = ["", "Keras / native step time:"]
    for p in pair_ratios:
        lines.append(
            f"  {p['model']:<12}{p['keras']:>15} / {p['native']:<18}"
            f"median {p['median_ratio']:.2f}x   min {p['min_ratio']:.2f}x"
            f"   cpu {p['cpu_ratio']:.2f}x"
            f"   (first-step loss rel. diff {p['first_loss_rel_diff']:.1e})"
        )
    if any("_local_" in p["keras"] for p in pair_ratios):
        lines.append(
            "  (*_local_*: each rank alone, no distribution, its share of "
            "the distributed step's work: Keras' own cost over torch)"
        )
    if any(p["native"].startswith("upstream_") for p in pair_ratios):
        lines.append(
            "  (upstream_local_*: the same on pristine Keras, in a worker "
            "process: what this package costs without a distribution)"
        )
    return lines


def _collective_lines(results):
    lines = ["", "Collectives per step (CommDebugMode; DDP: comm-hook count):"]
    for r in results:
        c = r["collectives"]
        if c is None:
            why = (
                "another process"
                if r["impl"].startswith("upstream_")
                else ("compiled step")
            )
            lines.append(f"  {r['model']}/{r['impl']}: not counted ({why})")
            continue
        extra = ""
        if "gradient_reduction" in c:
            extra = f", gradient reduction {c['gradient_reduction']}"
        lines.append(
            f"  {r['model']}/{r['impl']}: forward+loss {c['forward']}, "
            f"backward {c['backward']}{extra}, optimizer alone "
            f"{c['optimizer_alone']}; {c['ops']}"
        )
    return lines


def _fmt(value):
    return "-" if value is None else str(value)
