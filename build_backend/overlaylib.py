"""Upstream Keras plus our overlay: the logic shared by the build and the tools.

The overlay is the repository's ``keras/`` directory:

* ``keras/**/X.py.diff`` is a unified diff against upstream ``keras/**/X.py``
  (git-style ``--- a/keras/...`` / ``+++ b/keras/...`` headers, strip 1);
* any other file is a new module, which must not exist upstream.

``torchdist_backend`` (the PEP 517 backend) and ``tools/overlay.py`` both
import this module, so the build, the export and the diff authoring agree.
Needs only the standard library and ``whatthepatch``.
"""

import difflib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

import whatthepatch

DIFF_SUFFIX = ".diff"
# The reviewer's table of our diffs: kept beside them, never built or exported.
OVERLAY_DOC = "keras/OVERLAY.md"


class OverlayError(Exception):
    """The overlay does not fit upstream Keras."""


def project_table(source):
    """Returns the ``[project]`` table of ``source/pyproject.toml``."""
    with open(Path(source) / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def upstream_version(version):
    """Returns the upstream version of ours: ``3.15.1+x`` gives ``3.15.1``."""
    return version.split("+")[0]


def installed_upstream(version):
    """Finds an installed, unmodified ``keras==version`` in this environment.

    Uses the distribution's metadata, never ``import keras``: from the source
    root, the repo's own ``keras/`` directory would shadow the import.

    Returns:
        The directory holding ``keras/`` and its dist-info (site-packages),
        or None when keras is absent or another version (ours, say).
    """
    try:
        dist = importlib.metadata.distribution("keras")
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != version:
        return None
    return Path(dist.locate_file(""))


def downloaded_upstream(version, cache_dir):
    """Downloads and unpacks the ``keras==version`` wheel, once per cache.

    Returns:
        ``cache_dir/keras-<version>``, laid out like site-packages.
    """
    cache_dir = Path(cache_dir)
    root = cache_dir / f"keras-{version}"
    if root.is_dir():
        return root
    cache_dir.mkdir(parents=True, exist_ok=True)
    # pip's chatter goes to stderr: `overlay.py export` may write to stdout.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            f"keras=={version}",
            "-d",
            str(cache_dir),
        ],
        check=True,
        stdout=sys.stderr,
    )
    wheel = cache_dir / f"keras-{version}-py3-none-any.whl"
    # Unpack beside and rename, so a half-unpacked tree is never taken as
    # complete (the rename is atomic; a concurrent run may win it).
    tmp = Path(tempfile.mkdtemp(dir=cache_dir))
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(tmp)
    try:
        tmp.rename(root)
    except OSError:
        shutil.rmtree(tmp)
    return root


def pristine_upstream(version, cache_dir):
    """Returns a root holding pristine ``keras==version``.

    Installed, or else downloaded into ``cache_dir``.
    """
    return installed_upstream(version) or downloaded_upstream(
        version, cache_dir
    )


def tree_files(root):
    """Lists the files under ``root/keras``, skipping bytecode caches.

    Returns:
        Sorted POSIX paths relative to ``root``, e.g. ``keras/src/x.py``.
    """
    root = Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root / "keras"):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        found += [
            (Path(dirpath) / name).relative_to(root).as_posix()
            for name in filenames
            if not name.endswith(".pyc")
        ]
    return sorted(found)


def read_overlay(source, upstream_files):
    """Splits the overlay into new files and diffs, checked against upstream.

    Args:
        source: the repository root (holding ``keras/``).
        upstream_files: the set of upstream paths, as from ``tree_files``.

    Returns:
        ``(new_files, diffs)``: the new files' paths, and a dict mapping each
        patched upstream path to its diff's path.

    Raises:
        OverlayError: a new file exists upstream, or a diff has no target.
    """
    new_files, diffs, errors = [], {}, []
    for rel in tree_files(source):
        if rel == OVERLAY_DOC:
            continue
        if rel.endswith(DIFF_SUFFIX):
            target = rel[: -len(DIFF_SUFFIX)]
            if target not in upstream_files:
                errors.append(f"{rel}: upstream Keras has no {target} to patch")
            diffs[target] = rel
        elif rel in upstream_files:
            errors.append(
                f"{rel} exists upstream: carry the change as "
                f"{rel}{DIFF_SUFFIX} (python tools/overlay.py edit {rel})"
            )
        else:
            new_files.append(rel)
    if errors:
        raise OverlayError("\n".join(errors))
    return new_files, diffs


def read_text(path):
    """Reads UTF-8 text with no newline translation."""
    return Path(path).read_bytes().decode("utf-8")


def write_text(path, text):
    """Writes UTF-8 text with no newline translation, making parent dirs."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))


def apply_diff(diff_text, original, target, diff_name):
    """Applies a one-file unified diff to the text of upstream ``target``.

    Args:
        diff_text: the diff, with ``a/<target>`` and ``b/<target>`` headers.
        original: upstream's text of ``target``.
        target: the patched file's path, e.g. ``keras/src/x.py``.
        diff_name: the diff's path, for error messages.

    Returns:
        The patched text.

    Raises:
        OverlayError: naming the diff and, where a hunk fails, the hunk
            number and its ``@@`` header.
    """
    patches = list(whatthepatch.parse_patch(diff_text))
    # whatthepatch drops the a/ b/ prefixes: check the header lines as written.
    names = re.findall(
        r"^(?:---|\+\+\+) (\S+)", diff_text.split("\n@@", 1)[0], re.MULTILINE
    )
    if len(patches) != 1 or names != [f"a/{target}", f"b/{target}"]:
        raise OverlayError(
            f"{diff_name}: expected one file's diff with headers "
            f"--- a/{target} and +++ b/{target}"
        )
    # Split on "\n" only: str.splitlines() also splits on \f, \x1c, ...
    lines = original.split("\n")
    ends_with_newline = lines[-1] == ""
    if ends_with_newline:
        lines.pop()
    try:
        lines = whatthepatch.apply_diff(patches[0], lines)
    except whatthepatch.exceptions.HunkApplyException as e:
        hunk_headers = re.findall(r"^@@ .*? @@", diff_text, re.MULTILINE)
        at = (
            hunk_headers[e.hunk - 1]
            if 0 < (e.hunk or 0) <= len(hunk_headers)
            else "?"
        )
        raise OverlayError(
            f"{diff_name}: hunk {e.hunk} ({at}) does not apply to "
            f"upstream {target}: {e}"
        ) from e
    return "\n".join(lines) + ("\n" if ends_with_newline else "")


def patched_texts(source, upstream_root):
    """Applies every overlay diff to its upstream file.

    Returns:
        ``(new_files, patched)``: the new files' paths, and a dict mapping
        each patched upstream path to its patched text.

    Raises:
        OverlayError: listing every diff that fails, or a bad overlay file.
    """
    new_files, diffs = read_overlay(source, set(tree_files(upstream_root)))
    patched, errors = {}, []
    for target, diff_rel in diffs.items():
        try:
            patched[target] = apply_diff(
                read_text(Path(source) / diff_rel),
                read_text(Path(upstream_root) / target),
                target,
                diff_rel,
            )
        except OverlayError as e:
            errors.append(str(e))
    if errors:
        raise OverlayError("\n".join(errors))
    return new_files, patched


def build_tree(source, upstream_root, dest, link_new=False):
    """Writes upstream Keras with the overlay applied to ``dest/keras``.

    Args:
        source: the repository root (holding the overlay ``keras/``).
        upstream_root: a root holding pristine upstream ``keras/``.
        dest: the output root; an existing ``dest/keras`` is replaced.
        link_new: symlink new files to the repository's instead of copying
            them (editable installs: edits show without a rebuild).

    Raises:
        OverlayError: the overlay does not fit upstream; nothing is written.
    """
    source, upstream_root, dest = Path(source), Path(upstream_root), Path(dest)
    new_files, patched = patched_texts(source, upstream_root)
    shutil.rmtree(dest / "keras", ignore_errors=True)
    for rel in tree_files(upstream_root):
        out = dest / rel
        if rel in patched:
            write_text(out, patched[rel])
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(upstream_root / rel, out)
    for rel in new_files:
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if link_new:
            out.symlink_to((source / rel).resolve())
        else:
            shutil.copyfile(source / rel, out)


def _lines(text):
    """Splits text after each "\\n" (not at \\f, \\x1c... as splitlines)."""
    return re.findall(r"[^\n]*\n|[^\n]+\Z", text)


def unified_diff(rel, old_text, new_text, new_file=False):
    """Returns a git-style unified diff of one file, 3 lines of context.

    Args:
        rel: the file's path, e.g. ``keras/src/x.py``.
        old_text: the text before (ignored for a new file).
        new_text: the text after.
        new_file: diff from ``/dev/null``, as a file creation.
    """
    lines = difflib.unified_diff(
        [] if new_file else _lines(old_text),
        _lines(new_text),
        "/dev/null" if new_file else f"a/{rel}",
        f"b/{rel}",
    )
    # A last line without a newline needs patch's marker to stay one line.
    return "".join(
        line
        if line.endswith("\n")
        else f"{line}\n\\ No newline at end of file\n"
        for line in lines
    )


def export_patch(source, upstream_root):
    """Returns the whole change as one diff against pristine upstream.

    Each file gets a ``diff --git`` line so that GNU patch and git apply also
    create empty new files (which have no hunk). Stored diffs are normalized:
    regenerated from upstream and the patched text.
    """
    new_files, patched = patched_texts(source, upstream_root)
    sections = []
    for rel in sorted(set(new_files) | set(patched)):
        if rel in patched:
            body = unified_diff(
                rel, read_text(Path(upstream_root) / rel), patched[rel]
            )
            if body:
                sections.append(f"diff --git a/{rel} b/{rel}\n{body}")
            continue
        try:
            text = read_text(Path(source) / rel)
        except UnicodeDecodeError:
            raise OverlayError(
                f"{rel}: not UTF-8 text, cannot export it"
            ) from None
        body = unified_diff(rel, "", text, new_file=True)
        sections.append(
            f"diff --git a/{rel} b/{rel}\nnew file mode 100644\n{body}"
        )
    return "".join(sections)
