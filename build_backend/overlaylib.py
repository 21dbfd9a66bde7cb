"""Upstream Keras plus our overlay: the logic shared by the build and the tools.

The overlay is the repository's ``keras/`` directory:

* ``keras/**/X.py.diff`` is a unified diff against upstream ``keras/**/X.py``
  (git-style ``--- a/keras/...`` / ``+++ b/keras/...`` headers, strip 1);
* ``keras/**/X.py.nightly.diff`` is its variant for the ``keras-nightly``
  base (Keras master): used there instead of ``X.py.diff``, ignored on the
  default base. An empty variant means "no change of ``X.py`` on this base"
  (master already does it, or moved the file away);
* any other file is a new module, which must not exist upstream, but for
  the few that replace a file of a base (``REPLACED``).

A base is upstream Keras as a requirement: ``keras==3.15.1`` (the default,
from our version) or ``keras-nightly==3.16.0.dev...``.

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
# The distributions a base may be, each with its diffs' variant name (None:
# the plain diffs alone).
BASE_VARIANTS = {"keras": None, "keras-nightly": "nightly"}
# New modules of ours that replace a file a base has: Keras master ships its
# own torch `distribution_lib.py`, which ours replaces as a whole.
REPLACED = {"nightly": ("keras/src/backend/torch/distribution_lib.py",)}


class OverlayError(Exception):
    """The overlay does not fit upstream Keras."""


class Base:
    """The upstream Keras an overlay is built on: a pinned requirement.

    Args:
        requirement: ``NAME==VERSION`` with NAME in ``BASE_VARIANTS``, e.g.
            ``keras==3.15.1`` or ``keras-nightly==3.16.0.dev2026102704``.
    """

    def __init__(self, requirement):
        name, sep, version = requirement.strip().partition("==")
        name = name.strip().lower().replace("_", "-")
        if not sep or name not in BASE_VARIANTS or not version.strip():
            raise OverlayError(
                "A base must be a pinned Keras requirement, one of "
                f"{', '.join(n + '==VERSION' for n in BASE_VARIANTS)}. "
                f"Received: base={requirement!r}"
            )
        self.distribution = name
        self.version = version.strip()
        self.variant = BASE_VARIANTS[name]

    @property
    def requirement(self):
        return f"{self.distribution}=={self.version}"

    @property
    def dist_info(self):
        """The name of the base wheel's dist-info directory."""
        return f"{self.distribution.replace('-', '_')}-{self.version}.dist-info"

    def __repr__(self):
        return f"Base({self.requirement!r})"


def default_base(source):
    """The base our version names: ``3.15.1+torchdist`` gives keras==3.15.1."""
    version = upstream_version(project_table(source)["version"])
    return Base(f"keras=={version}")


def base_of(source, version):
    """The base a package of ours was built on, from its version.

    ``3.15.1+torchdist`` gives the default base; another upstream version
    (``3.16.0.dev2026102704+torchdist``) a ``keras-nightly`` one.
    """
    default = default_base(source)
    upstream = upstream_version(version)
    if upstream == default.version:
        return default
    return Base(f"keras-nightly=={upstream}")


def resolve_base(source, requirement=None):
    """Returns ``Base(requirement)``, or the default base when it is None."""
    if not requirement:
        return default_base(source)
    return Base(requirement)


def our_version(project, base):
    """Our version on a base: its version with our local label."""
    _, _, label = project["version"].partition("+")
    return f"{base.version}+{label}" if label else base.version


def project_table(source):
    """Returns the ``[project]`` table of ``source/pyproject.toml``."""
    with open(Path(source) / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def upstream_version(version):
    """Returns the upstream version of ours: ``3.15.1+x`` gives ``3.15.1``."""
    return version.split("+")[0]


def installed_upstream(version, distribution="keras"):
    """Finds an installed, unmodified ``distribution==version`` here.

    Uses the distribution's metadata, never ``import keras``: from the source
    root, the repo's own ``keras/`` directory would shadow the import.

    Returns:
        The directory holding ``keras/`` and its dist-info (site-packages),
        or None when keras is absent or another version (ours, say).
    """
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != version:
        return None
    return Path(dist.locate_file(""))


def downloaded_upstream(version, cache_dir, distribution="keras"):
    """Downloads and unpacks the ``distribution==version`` wheel, once.

    Returns:
        ``cache_dir/<distribution>-<version>``, laid out like site-packages.
    """
    cache_dir = Path(cache_dir)
    root = cache_dir / f"{distribution}-{version}"
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
            f"{distribution}=={version}",
            "-d",
            str(cache_dir),
        ],
        check=True,
        stdout=sys.stderr,
    )
    wheel_stem = distribution.replace("-", "_")
    wheel = cache_dir / f"{wheel_stem}-{version}-py3-none-any.whl"
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


def pristine_upstream(version, cache_dir, distribution="keras"):
    """Returns a root holding pristine ``distribution==version``.

    Installed, or else downloaded into ``cache_dir``.
    """
    return installed_upstream(version, distribution) or downloaded_upstream(
        version, cache_dir, distribution
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


def diff_target(rel):
    """Splits a diff's path into ``(target, variant)``.

    ``keras/x.py.diff`` gives ``("keras/x.py", None)``, and
    ``keras/x.py.nightly.diff`` gives ``("keras/x.py", "nightly")``.
    """
    stem = rel[: -len(DIFF_SUFFIX)]
    head, _, last = stem.rpartition(".")
    variants = {v for v in BASE_VARIANTS.values() if v}
    if head and last in variants:
        return head, last
    return stem, None


def read_overlay(source, upstream_files, variant=None):
    """Splits the overlay into new files and diffs, checked against upstream.

    Args:
        source: the repository root (holding ``keras/``).
        upstream_files: the set of upstream paths, as from ``tree_files``.
        variant: the base's variant name (``"nightly"``), or None for the
            plain diffs alone.

    Returns:
        ``(new_files, diffs)``: the new files' paths (a few replace an
        upstream file: ``REPLACED``), and a dict mapping each patched
        upstream path to its diff's path. On a variant base, a variant diff
        takes the place of the plain diff of its target; an empty variant
        drops the target from the dict.

    Raises:
        OverlayError: a new file exists upstream, or a diff has no target.
    """
    new_files, plain, variants, errors = [], {}, {}, []
    replaced = REPLACED.get(variant, ())
    for rel in tree_files(source):
        if rel == OVERLAY_DOC:
            continue
        if rel.endswith(DIFF_SUFFIX):
            target, diff_variant = diff_target(rel)
            if diff_variant is None:
                plain[target] = rel
            elif diff_variant == variant:
                variants[target] = rel
        elif rel in upstream_files and rel not in replaced:
            errors.append(
                f"{rel} exists upstream: carry the change as "
                f"{rel}{DIFF_SUFFIX} (python tools/overlay.py edit {rel})"
            )
        else:
            new_files.append(rel)
    diffs = dict(plain)
    for target, rel in variants.items():
        diffs.pop(target, None)
        if (Path(source) / rel).stat().st_size:
            diffs[target] = rel
    for target, rel in diffs.items():
        if target not in upstream_files:
            errors.append(f"{rel}: upstream Keras has no {target} to patch")
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


def _hunks(patch):
    """Yields each hunk of a parsed diff as ``(old start, old, new)``.

    ``old start`` is the hunk's first old line number (1-based; None for a
    hunk without old lines), ``old`` and ``new`` its lines before and after.
    """
    by_hunk = {}
    for change in patch.changes or ():
        by_hunk.setdefault(change.hunk, []).append(change)
    for changes in by_hunk.values():
        olds = [c.old for c in changes if c.old is not None]
        yield (
            min(olds) if olds else None,
            [c.line for c in changes if c.old is not None],
            [c.line for c in changes if c.new is not None],
        )


def _find_block(lines, block, expected, start):
    """The index nearest ``expected`` (>= ``start``) where ``block`` is.

    Returns None when ``lines`` hold no exact copy of ``block`` there.
    """
    size, last = len(block), len(lines) - len(block)
    for distance in range(max(expected - start, last - expected) + 1):
        for at in (expected - distance, expected + distance):
            if start <= at <= last and lines[at : at + size] == block:
                return at
    return None


def apply_diff(diff_text, original, target, diff_name):
    """Applies a one-file unified diff to the text of upstream ``target``.

    Each hunk's context and removed lines must match exactly; as GNU patch
    and ``git apply`` do, a hunk is found where upstream moved it (the
    nearest offset from its header's line, after the previous hunk), so
    a diff serves a base whose file only grew elsewhere.

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
    hunk_headers = re.findall(r"^@@ .*? @@", diff_text, re.MULTILINE)
    out, done, offset = [], 0, 0
    for number, (old_start, old, new) in enumerate(_hunks(patches[0]), 1):
        expected = (old_start - 1 if old_start else done) + offset
        at = _find_block(lines, old, max(expected, done), done)
        if at is None:
            header = (
                hunk_headers[number - 1] if number <= len(hunk_headers) else "?"
            )
            raise OverlayError(
                f"{diff_name}: hunk {number} ({header}) does not apply to "
                f"upstream {target}: its context and removed lines are "
                "nowhere after the previous hunk. Update the diff, or add a "
                "variant for this base (python tools/overlay.py edit --force "
                f"[--base REQUIREMENT] {target})."
            )
        if old_start:
            offset = at - (old_start - 1)
        out += lines[done:at] + new
        done = at + len(old)
    out += lines[done:]
    return "\n".join(out) + ("\n" if ends_with_newline else "")


def patched_texts(source, upstream_root, variant=None):
    """Applies every overlay diff of a base to its upstream file.

    Args:
        source: the repository root (holding the overlay ``keras/``).
        upstream_root: a root holding pristine upstream ``keras/``.
        variant: the base's variant name (``Base.variant``).

    Returns:
        ``(new_files, patched)``: the new files' paths, and a dict mapping
        each patched upstream path to its patched text.

    Raises:
        OverlayError: listing every diff that fails, or a bad overlay file.
    """
    new_files, diffs = read_overlay(
        source, set(tree_files(upstream_root)), variant
    )
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


def build_tree(source, upstream_root, dest, link_new=False, variant=None):
    """Writes upstream Keras with the overlay applied to ``dest/keras``.

    Args:
        source: the repository root (holding the overlay ``keras/``).
        upstream_root: a root holding pristine upstream ``keras/``.
        dest: the output root; an existing ``dest/keras`` is replaced.
        link_new: symlink new files to the repository's instead of copying
            them (editable installs: edits show without a rebuild).
        variant: the base's variant name (``Base.variant``).

    Raises:
        OverlayError: the overlay does not fit upstream; nothing is written.
    """
    source, upstream_root, dest = Path(source), Path(upstream_root), Path(dest)
    new_files, patched = patched_texts(source, upstream_root, variant)
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
        out.unlink(missing_ok=True)  # a base's file that ours replaces
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


def export_sections(source, upstream_root, variant=None):
    """The whole change as one diff section per file, against upstream.

    Each section starts with a ``diff --git`` line so that GNU patch and git
    apply also create empty new files (which have no hunk). Stored diffs are
    normalized: regenerated from upstream and the patched text.

    Returns:
        A dict mapping each changed or new path to its section, sorted.
    """
    new_files, patched = patched_texts(source, upstream_root, variant)
    upstream_files = set(tree_files(upstream_root))
    for rel in set(new_files) & upstream_files:  # ours replaces the base's
        patched[rel] = read_text(Path(source) / rel)
    sections = {}
    for rel in sorted(set(new_files) | set(patched)):
        if rel in patched:
            body = unified_diff(
                rel, read_text(Path(upstream_root) / rel), patched[rel]
            )
            if body:
                sections[rel] = f"diff --git a/{rel} b/{rel}\n{body}"
            continue
        try:
            text = read_text(Path(source) / rel)
        except UnicodeDecodeError:
            raise OverlayError(
                f"{rel}: not UTF-8 text, cannot export it"
            ) from None
        sections[rel] = new_file_section(rel, text)
    return sections


def new_file_section(rel, text):
    """The ``diff --git`` section that creates ``rel`` with ``text``."""
    body = unified_diff(rel, "", text, new_file=True)
    return f"diff --git a/{rel} b/{rel}\nnew file mode 100644\n{body}"


def export_patch(source, upstream_root, variant=None):
    """Returns the whole change as one diff against pristine upstream (the
    sections of ``export_sections``, in path order)."""
    return "".join(export_sections(source, upstream_root, variant).values())
