#!/usr/bin/env python3
"""Author and export our change to upstream Keras.

Usage:
    python tools/overlay.py export [-o FILE]   # the whole change as one diff
    python tools/overlay.py edit keras/src/backend/torch/core.py
    # ... edit build/edit/keras/src/backend/torch/core.py ...
    python tools/overlay.py save keras/src/backend/torch/core.py

``edit`` writes upstream's file with our current diff applied to
``build/edit/<PATH>``; ``save`` turns that file back into ``<PATH>.diff``
(or deletes the diff when the file equals upstream again). New modules need
no tool: edit them in place under ``keras/``.

Pristine upstream comes from an installed keras==3.15.1 when there is one,
else from ``pip download`` into ``build/upstream/`` (once). The logic is
shared with the build backend (build_backend/overlaylib.py).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "build_backend"))
import overlaylib  # noqa: E402


def _upstream(root):
    """Returns the root of a pristine upstream Keras for this repository."""
    version = overlaylib.project_table(root)["version"]
    return overlaylib.pristine_upstream(
        overlaylib.upstream_version(version), root / "build" / "upstream"
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
    """Returns ``path`` relative to the root, also from build/edit/..."""
    path = Path(path)
    rel = path.resolve().relative_to(root) if path.is_absolute() else path
    rel = rel.as_posix()
    return rel.removeprefix("build/edit/")


def export(root, output):
    """Writes the whole change as one unified diff (stdout when no output)."""
    patch = overlaylib.export_patch(root, _upstream(root))
    if output:
        Path(output).write_text(patch, encoding="utf-8")
    else:
        sys.stdout.write(patch)


def edit(root, rel, force):
    """Writes upstream + our current diff to build/edit/<rel>."""
    upstream_root = _upstream(root)
    text = _upstream_file(root, upstream_root, rel)
    out = root / "build" / "edit" / rel
    if out.exists() and not force:
        sys.exit(f"{out} exists (unsaved edits?): save it, or use --force")
    diff = root / (rel + overlaylib.DIFF_SUFFIX)
    if diff.exists():
        text = overlaylib.apply_diff(
            overlaylib.read_text(diff),
            text,
            rel,
            diff.relative_to(root).as_posix(),
        )
    overlaylib.write_text(out, text)
    print(f"edit {out}, then: python tools/overlay.py save {rel}")


def save(root, rel):
    """Turns build/edit/<rel> into keras/.../<rel>.diff."""
    upstream_text = _upstream_file(root, _upstream(root), rel)
    edited = overlaylib.read_text(root / "build" / "edit" / rel)
    # Stored diffs never end without a newline: keeps them simple to apply.
    if not edited.endswith("\n"):
        edited += "\n"
    diff = root / (rel + overlaylib.DIFF_SUFFIX)
    body = overlaylib.unified_diff(rel, upstream_text, edited)
    if body:
        overlaylib.write_text(diff, body)
        print(f"wrote {diff.relative_to(root)}")
    elif diff.exists():
        diff.unlink()
        print(f"{rel} equals upstream: removed {diff.relative_to(root)}")
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
    commands = parser.add_subparsers(dest="command", required=True)
    export_parser = commands.add_parser("export", help="the change as one diff")
    export_parser.add_argument(
        "-o", "--output", help="file to write (default: stdout)"
    )
    edit_parser = commands.add_parser("edit", help="materialize a file to edit")
    edit_parser.add_argument(
        "path", help="e.g. keras/src/backend/torch/core.py"
    )
    edit_parser.add_argument(
        "--force", action="store_true", help="overwrite build/edit/PATH"
    )
    save_parser = commands.add_parser(
        "save", help="store an edited file as a diff"
    )
    save_parser.add_argument(
        "path", help="e.g. keras/src/backend/torch/core.py"
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        if args.command == "export":
            export(root, args.output)
        elif args.command == "edit":
            edit(root, _relative(root, args.path), args.force)
        else:
            save(root, _relative(root, args.path))
    except overlaylib.OverlayError as e:
        sys.exit(f"overlay error:\n{e}")


if __name__ == "__main__":
    main()
