"""In-tree PEP 517/660 build backend: upstream Keras plus our overlay.

``pip install .`` builds a wheel named ``keras`` at our version (the
``[project] version`` in pyproject.toml, e.g. ``3.15.1+torchdist``) holding
upstream Keras, taken from the build requirement ``keras==3.15.1``, with every
``keras/**/X.py.diff`` of the repository applied and every other
``keras/**`` file added as a new module. The metadata is upstream's
(dependencies, Requires-Python, summary, license...) with our version and the
extras of ``[project.optional-dependencies]``.

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


def _upstream(version):
    """Returns the root of the build requirement keras==<upstream version>."""
    wanted = overlaylib.upstream_version(version)
    root = overlaylib.installed_upstream(wanted)
    if root is None:
        raise overlaylib.OverlayError(
            f"the build environment lacks keras=={wanted} "
            "(a build requirement: build with pip's default build isolation)"
        )
    return root


def core_metadata(upstream_metadata, project):
    """Returns our METADATA: upstream's, with our version and our extras.

    Args:
        upstream_metadata: the text of upstream's METADATA file.
        project: the ``[project]`` table of pyproject.toml.
    """
    head, blank, body = upstream_metadata.partition("\n\n")
    lines = [
        f"Version: {project['version']}"
        if line.startswith("Version:")
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


def _dist_info_files(upstream_root, project):
    """Returns ``{name: bytes}`` for our dist-info, from upstream's."""
    upstream_info = (
        Path(upstream_root)
        / f"keras-{overlaylib.upstream_version(project['version'])}.dist-info"
    )
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
    project = overlaylib.project_table(".")
    upstream_root = _upstream(project["version"])
    with tempfile.TemporaryDirectory() as tmp:
        overlaylib.build_tree(".", upstream_root, tmp)
        files = {
            rel: (Path(tmp) / rel).read_bytes()
            for rel in overlaylib.tree_files(tmp)
        }
    return write_wheel(
        wheel_directory,
        project,
        files,
        _dist_info_files(upstream_root, project),
    )


def build_editable(
    wheel_directory, config_settings=None, metadata_directory=None
):
    """PEP 660 hook: build/editable/keras plus a .pth file pointing at it."""
    project = overlaylib.project_table(".")
    upstream_root = _upstream(project["version"])
    editable_root = Path("build", "editable").resolve()
    overlaylib.build_tree(".", upstream_root, editable_root, link_new=True)
    pth = {
        f"{project['name']}-torchdist-editable.pth": (
            f"{editable_root}\n".encode()
        )
    }
    return write_wheel(
        wheel_directory, project, pth, _dist_info_files(upstream_root, project)
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
    project = overlaylib.project_table(".")
    metadata = _dist_info_files(_upstream(project["version"]), project)[
        "METADATA"
    ]
    stem = f"{project['name']}-{project['version']}"
    with tarfile.open(Path(sdist_directory) / f"{stem}.tar.gz", "w:gz") as tar:
        for path in SDIST_PATHS:
            tar.add(path, f"{stem}/{path}", filter=_sdist_filter)
        info = tarfile.TarInfo(f"{stem}/PKG-INFO")
        info.size = len(metadata)
        tar.addfile(info, io.BytesIO(metadata))
    return f"{stem}.tar.gz"
