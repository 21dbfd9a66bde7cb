#!/usr/bin/env python3
"""Author and export our change to upstream Keras.

Usage:
    python tools/overlay.py export [-o FILE]   # the whole change as one diff
    python tools/overlay.py export --series DIR  # ... as a series of patches
    python tools/overlay.py check-series DIR   # each step applied, tested
    python tools/overlay.py edit keras/src/backend/torch/core.py
    # ... edit build/edit/keras/src/backend/torch/core.py ...
    python tools/overlay.py save keras/src/backend/torch/core.py

``edit`` writes upstream's file with our current diff applied to
``build/edit/<PATH>``; ``save`` turns that file back into ``<PATH>.diff``
(or deletes the diff when the file equals upstream again). New modules need
no tool: edit them in place under ``keras/``.

Every command takes ``--base REQUIREMENT``: the
default is keras==3.15.1; ``--base keras-nightly==3.16.0.dev2026102704``
exports against that Keras master nightly, and ``edit`` / ``save`` work on
``build/edit-nightly/<PATH>`` and the variant ``<PATH>.nightly.diff``
(deleted again when the plain diff gives the same file there).

``export`` carries our tests too, moved to upstream's layout (``*_test.py``
beside the modules they test, the harness and shared test modules in
``keras/src/testing/torch_distribution/``, ``tests.X`` imports rewritten),
as ``tools/export_plan.toml`` maps them; the files it leaves out are listed
there with their reason (``--no-tests``: the overlay alone). ``--series
DIR`` writes the same change as that plan's steps, one ``git format-patch``
file each, in import order: a step's files import only upstream modules and
files of earlier steps, and an upstream file goes whole to one step.
``check-series`` applies the steps one after the other to the base's tree
and runs each step's tests there. Why it is cut so: ``tools/series.py``.

Pristine upstream comes from an installed base when there is one, else from
``pip download`` into ``build/upstream/`` (once). The logic is shared with
the build backend (build_backend/overlaylib.py).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "build_backend"))
import overlaylib  # noqa: E402
import series  # noqa: E402


def _upstream(root, base):
    """Returns the root of a pristine upstream Keras for this base."""
    return overlaylib.pristine_upstream(
        base.version, root / "build" / "upstream", base.distribution
    )


def _edit_dir(root, base):
    suffix = f"-{base.variant}" if base.variant else ""
    return root / "build" / f"edit{suffix}"


def _diff_path(root, rel, base):
    """The diff of ``rel`` that ``save`` writes on this base."""
    variant = f".{base.variant}" if base.variant else ""
    return root / f"{rel}{variant}{overlaylib.DIFF_SUFFIX}"


def _patched(root, upstream_root, rel, base, diff):
    """Upstream ``rel`` with ``diff`` applied (upstream's when absent)."""
    text = overlaylib.read_text(upstream_root / rel)
    if not diff.exists() or not diff.stat().st_size:
        return text
    return overlaylib.apply_diff(
        overlaylib.read_text(diff),
        text,
        rel,
        diff.relative_to(root).as_posix(),
    )


def _upstream_file(root, upstream_root, rel):
    """Checks that ``rel`` names an upstream file and returns its text."""
    if not rel.startswith("keras/") or not (upstream_root / rel).is_file():
        sys.exit(
            f"{rel}: not an upstream Keras file (new modules are edited in "
            "place under keras/)"
        )
    return overlaylib.read_text(upstream_root / rel)


def _relative(root, path):
    """Returns ``path`` relative to the root, also from build/edit*/..."""
    path = Path(path)
    rel = path.resolve().relative_to(root) if path.is_absolute() else path
    parts = rel.as_posix().split("/")
    if parts[0] == "build" and parts[1:2] and parts[1].startswith("edit"):
        parts = parts[2:]
    return "/".join(parts)


def export(root, output, base, with_tests=True, series_dir=None):
    """Writes the whole change as one unified diff (stdout when no output),
    our tests in upstream's layout; or, with ``series_dir``, as the plan's
    series of patches, one per step, and prints each step's size."""
    upstream_root = _upstream(root, base)
    if series_dir:
        written = series.write_series(
            root, upstream_root, base.variant, series_dir
        )
        for name, step, size in written:
            tests = len(step.get("tests", []))
            print(f"{name}: {size} lines, {tests} test files")
        print(f"{len(written)} patches in {series_dir}")
        return
    sections = series.export_sections(
        root, upstream_root, base.variant, with_tests
    )
    patch = "".join(sections.values())
    if output:
        Path(output).write_text(patch, encoding="utf-8")
    else:
        sys.stdout.write(patch)


def edit(root, rel, force, base):
    """Writes upstream + our current diff to build/edit[-variant]/<rel>.

    On a variant base, starts from the variant diff where there is one, else
    from the plain diff where it applies, else from upstream's file.
    """
    upstream_root = _upstream(root, base)
    _upstream_file(root, upstream_root, rel)
    out = _edit_dir(root, base) / rel
    if out.exists() and not force:
        sys.exit(f"{out} exists (unsaved edits?): save it, or use --force")
    variant = _diff_path(root, rel, base)
    plain = root / (rel + overlaylib.DIFF_SUFFIX)
    try:
        diff = variant if variant.exists() else plain
        text = _patched(root, upstream_root, rel, base, diff)
    except overlaylib.OverlayError as e:
        print(f"{e}\nstarting from upstream's {rel}")
        text = overlaylib.read_text(upstream_root / rel)
    overlaylib.write_text(out, text)
    flag = f"--base {base.requirement} " if base.variant else ""
    print(f"edit {out}, then: python tools/overlay.py save {flag}{rel}")


def _plain_result(root, upstream_root, rel, base):
    """What the plain diff of ``rel`` gives on this base (None: nothing)."""
    plain = root / (rel + overlaylib.DIFF_SUFFIX)
    if not base.variant or not plain.exists():
        return None
    try:
        return _patched(root, upstream_root, rel, base, plain)
    except overlaylib.OverlayError:
        return None


def save(root, rel, base):
    """Turns build/edit[-variant]/<rel> into <rel>[.variant].diff."""
    upstream_root = _upstream(root, base)
    upstream_text = _upstream_file(root, upstream_root, rel)
    edited = overlaylib.read_text(_edit_dir(root, base) / rel)
    # Stored diffs never end without a newline: keeps them simple to apply.
    if not edited.endswith("\n"):
        edited += "\n"
    diff = _diff_path(root, rel, base)
    shown = diff.relative_to(root)
    plain = root / (rel + overlaylib.DIFF_SUFFIX)
    body = overlaylib.unified_diff(rel, upstream_text, edited)
    if _plain_result(root, upstream_root, rel, base) == edited:
        diff.unlink(missing_ok=True)
        print(f"{rel}: the plain diff gives this file; no {shown}")
    elif body:
        overlaylib.write_text(diff, body)
        print(f"wrote {shown}")
    elif base.variant and plain.exists():
        overlaylib.write_text(diff, "")  # no change on this base
        print(f"{rel} equals upstream here: wrote an empty {shown}")
    elif diff.exists():
        diff.unlink()
        print(f"{rel} equals upstream: removed {shown}")
    else:
        print(f"{rel} equals upstream: no diff to write")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parents[1],
        help="repository root (default: this checkout)",
    )
    based = argparse.ArgumentParser(add_help=False)
    based.add_argument(
        "--base",
        help="the upstream Keras, e.g. keras-nightly==3.16.0.dev2026102704 "
        "(default: keras==<our version>)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    export_parser = commands.add_parser(
        "export", parents=[based], help="the change as one diff"
    )
    export_parser.add_argument(
        "-o", "--output", help="file to write (default: stdout)"
    )
    export_parser.add_argument(
        "--series",
        metavar="DIR",
        help="write the change as a series of patches into DIR instead "
        "(the steps of tools/export_plan.toml)",
    )
    export_parser.add_argument(
        "--no-tests",
        action="store_true",
        help="leave our tests out (the overlay alone)",
    )
    check_parser = commands.add_parser(
        "check-series",
        parents=[based],
        help="write the series into DIR, then apply its steps one by one "
        "to the base's tree and run each step's tests there",
    )
    check_parser.add_argument("dir", help="the series' directory")
    check_parser.add_argument(
        "--python",
        help="the interpreter with torch and pytest (default: "
        ".venv-nightly's on the nightly base, else .venv's)",
    )
    check_parser.add_argument(
        "--steps", help="only these steps' tests, e.g. 1,4-6 (all applied)"
    )
    check_parser.add_argument(
        "--timeout", type=int, default=900, help="seconds per step's tests"
    )
    edit_parser = commands.add_parser(
        "edit", parents=[based], help="materialize a file to edit"
    )
    edit_parser.add_argument(
        "path", help="e.g. keras/src/backend/torch/core.py"
    )
    edit_parser.add_argument(
        "--force", action="store_true", help="overwrite build/edit/PATH"
    )
    save_parser = commands.add_parser(
        "save", parents=[based], help="store an edited file as a diff"
    )
    save_parser.add_argument(
        "path", help="e.g. keras/src/backend/torch/core.py"
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        base = overlaylib.resolve_base(root, args.base)
        if args.command == "export":
            export(root, args.output, base, not args.no_tests, args.series)
        elif args.command == "check-series":
            python = args.python or str(
                root
                / (".venv-nightly" if base.variant else ".venv")
                / "bin"
                / "python"
            )
            ok = series.check_series(
                root,
                _upstream(root, base),
                base.variant,
                Path(args.dir),
                python,
                series.parse_steps(args.steps),
                args.timeout,
            )
            sys.exit(0 if ok else 1)
        elif args.command == "edit":
            edit(root, _relative(root, args.path), args.force, base)
        else:
            save(root, _relative(root, args.path), base)
    except overlaylib.OverlayError as e:
        sys.exit(f"overlay error:\n{e}")


if __name__ == "__main__":
    main()
