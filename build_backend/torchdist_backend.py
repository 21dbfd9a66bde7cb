"""In-tree PEP 517/660 build backend: upstream Keras plus our overlay.

``pip install .`` builds a wheel named ``keras`` at our version (the
``[project] version`` in pyproject.toml, e.g. ``3.15.1+torchdist``) holding
upstream Keras, taken from the build requirement ``keras==3.15.1``, with every
``keras/**/X.py.diff`` of the repository applied and every other
``keras/**`` file added as a new module. The metadata is upstream's
(dependencies, Requires-Python, summary, license...) with our version and the
extras of ``[project.optional-dependencies]``.

The base is a build-time choice, the PEP 517 config setting ``base``:
``pip install . -C base=keras-nightly==3.16.0.dev2026102704`` builds on that
Keras master nightly instead (its ``*.nightly.diff`` variants applied), as
``keras`` at ``3.16.0.dev2026102704+torchdist``. The base is a build
requirement returned by the ``get_requires_for_build_*`` hooks, so pip
installs it into the isolated build environment.

``pip install -e .`` builds the tree into ``<repo>/build/editable/keras/``:
upstream files are copies (patched where a diff exists), our new modules are
symlinks to the repository's files, and the editable wheel holds only a
``.pth`` file that puts ``<repo>/build/editable`` on ``sys.path``. So edits to
our new modules take effect at once, while editing a ``.diff`` or adding or
removing a module needs ``pip install -e .`` again.

Wheels are written with the standard library alone (zipfile, hashlib, csv).
"""

import base64
import csv
import hashlib
import io
import tarfile
import tempfile
import zipfile
from pathlib import Path

import overlaylib

TAG = "py3-none-any"
# Fixed timestamps make the wheel depend on its content alone.
ZIP_DATE = (1980, 1, 1, 0, 0, 0)
SDIST_PATHS = ("pyproject.toml", "README.md", "build_backend", "keras", "tools")


def _base(config_settings):
    """The base of this build: the ``base`` config setting, or the default."""
    return overlaylib.resolve_base(".", (config_settings or {}).get("base"))


def _upstream(base):
    """Returns the root of the installed build requirement, the base."""
    root = overlaylib.installed_upstream(base.version, base.distribution)
    if root is None:
        raise overlaylib.OverlayError(
            f"the build environment lacks {base.requirement} "
            "(a build requirement: build with pip's default build isolation)"
        )
    return root


def _requires(config_settings):
    return [_base(config_settings).requirement]


def get_requires_for_build_wheel(config_settings=None):
    """PEP 517 hook: the base Keras (``keras==3.15.1`` by default)."""
    return _requires(config_settings)


def get_requires_for_build_editable(config_settings=None):
    """PEP 660 hook: the base Keras, as for a wheel."""
    return _requires(config_settings)


def get_requires_for_build_sdist(config_settings=None):
    """PEP 517 hook: the base Keras, whose metadata PKG-INFO takes."""
    return _requires(config_settings)


def _project(base):
    """The ``[project]`` table, with our version on this base."""
    project = dict(overlaylib.project_table("."))
    project["version"] = overlaylib.our_version(project, base)
    return project


def core_metadata(upstream_metadata, project):
    """Returns our METADATA: upstream's, with our version and our extras.

    Args:
        upstream_metadata: the text of upstream's METADATA file.
        project: the ``[project]`` table of pyproject.toml.
    """
    head, blank, body = upstream_metadata.partition("\n\n")
    ours = {"Version": project["version"], "Name": project["name"]}
    lines = [
        f"{line.partition(':')[0]}: {ours[line.partition(':')[0]]}"
        if line.partition(":")[0] in ours
        else line
        for line in head.split("\n")
    ]
    for extra, requirements in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        for requirement in requirements:
            name, _, marker = requirement.partition(";")
            marker = f"({marker.strip()}) and " if marker.strip() else ""
            lines.append(
                f'Requires-Dist: {name.strip()}; {marker}extra == "{extra}"'
            )
    return "\n".join(lines) + blank + body


def _dist_info_files(upstream_root, project, base):
    """Returns ``{name: bytes}`` for our dist-info, from upstream's."""
    upstream_info = Path(upstream_root) / base.dist_info
    files = {
        "METADATA": core_metadata(
            overlaylib.read_text(upstream_info / "METADATA"), project
        ).encode(),
        "WHEEL": (
            "Wheel-Version: 1.0\nGenerator: torchdist_backend\n"
            f"Root-Is-Purelib: true\nTag: {TAG}\n"
        ).encode(),
    }
    if (upstream_info / "entry_points.txt").exists():
        files["entry_points.txt"] = (
            upstream_info / "entry_points.txt"
        ).read_bytes()
    # Apache-2.0 asks us to ship upstream's license; METADATA names it.
    for path in sorted((upstream_info / "licenses").rglob("*")):
        if path.is_file():
            files[path.relative_to(upstream_info).as_posix()] = (
                path.read_bytes()
            )
    return files


def _zip_add(zf, arcname, data):
    """Adds a regular file with fixed time and mode."""
    info = zipfile.ZipInfo(arcname, ZIP_DATE)
    info.external_attr = 0o644 << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    zf.writestr(info, data)


def _record_hash(data):
    """Returns a RECORD hash entry: urlsafe base64 sha256, no padding."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
    return "sha256=" + digest.rstrip(b"=").decode()


def write_wheel(wheel_directory, project, files, dist_info):
    """Writes a wheel with a RECORD of hashes.

    Args:
        wheel_directory: where to put the wheel.
        project: the ``[project]`` table (name and version).
        files: ``{archive path: bytes}`` for the payload.
        dist_info: ``{name: bytes}`` for the dist-info directory.

    Returns:
        The wheel's file name.
    """
    stem = f"{project['name']}-{project['version']}"
    info_dir = f"{stem}.dist-info"
    entries = dict(files)
    entries.update(
        {f"{info_dir}/{name}": data for name, data in dist_info.items()}
    )
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    wheel_name = f"{stem}-{TAG}.whl"
    with zipfile.ZipFile(Path(wheel_directory) / wheel_name, "w") as zf:
        for arcname, data in entries.items():
            _zip_add(zf, arcname, data)
            writer.writerow([arcname, _record_hash(data), len(data)])
        writer.writerow([f"{info_dir}/RECORD", "", ""])
        _zip_add(zf, f"{info_dir}/RECORD", record.getvalue().encode())
    return wheel_name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    """PEP 517 hook: upstream Keras with the overlay applied."""
    base = _base(config_settings)
    project = _project(base)
    upstream_root = _upstream(base)
    with tempfile.TemporaryDirectory() as tmp:
        overlaylib.build_tree(".", upstream_root, tmp, variant=base.variant)
        files = {
            rel: (Path(tmp) / rel).read_bytes()
            for rel in overlaylib.tree_files(tmp)
        }
    return write_wheel(
        wheel_directory,
        project,
        files,
        _dist_info_files(upstream_root, project, base),
    )


def build_editable(
    wheel_directory, config_settings=None, metadata_directory=None
):
    """PEP 660 hook: build/editable/keras plus a .pth file pointing at it.

    On a variant base the tree is ``build/editable-<variant>/`` (``-nightly``),
    so that environments of both bases can be editable at once.
    """
    base = _base(config_settings)
    project = _project(base)
    upstream_root = _upstream(base)
    suffix = f"-{base.variant}" if base.variant else ""
    editable_root = Path("build", f"editable{suffix}").resolve()
    overlaylib.build_tree(
        ".", upstream_root, editable_root, link_new=True, variant=base.variant
    )
    pth = {
        f"{project['name']}-torchdist-editable.pth": (
            f"{editable_root}\n".encode()
        )
    }
    return write_wheel(
        wheel_directory,
        project,
        pth,
        _dist_info_files(upstream_root, project, base),
    )


def _sdist_filter(info):
    """Drops caches and normalizes owners and times of sdist members."""
    if "__pycache__" in info.name.split("/") or info.name.endswith(".pyc"):
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


def build_sdist(sdist_directory, config_settings=None):
    """PEP 517 hook: our repository files (overlay, backend, tools)."""
    base = _base(config_settings)
    project = _project(base)
    metadata = _dist_info_files(_upstream(base), project, base)["METADATA"]
    stem = f"{project['name']}-{project['version']}"
    with tarfile.open(Path(sdist_directory) / f"{stem}.tar.gz", "w:gz") as tar:
        for path in SDIST_PATHS:
            tar.add(path, f"{stem}/{path}", filter=_sdist_filter)
        info = tarfile.TarInfo(f"{stem}/PKG-INFO")
        info.size = len(metadata)
        tar.addfile(info, io.BytesIO(metadata))
    return f"{stem}.tar.gz"
