"""The installed package is upstream Keras 3.15.1 plus exactly our overlay.

Runs in the environment that run_tests.sh sets up (the package installed).
Pristine upstream is downloaded once into build/upstream/.
"""

import difflib
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "build_backend"))
import overlaylib  # noqa: E402

PROJECT = overlaylib.project_table(REPO)
UPSTREAM_VERSION = overlaylib.upstream_version(PROJECT["version"])


@pytest.fixture(scope="session")
def pristine():
    """A root holding pristine upstream keras/ and its dist-info."""
    return overlaylib.pristine_upstream(
        UPSTREAM_VERSION, REPO / "build" / "upstream"
    )


@pytest.fixture(scope="session")
def installed():
    """The root holding the imported keras package (regular or editable)."""
    spec = importlib.util.find_spec("keras")
    assert spec is not None and spec.origin, "keras is not installed"
    package = Path(spec.origin).parent
    assert package.resolve() != (REPO / "keras").resolve()
    return package.parent


def _overlay(pristine):
    """Returns (new files, {patched upstream path: diff path}) of the repo."""
    return overlaylib.read_overlay(REPO, set(overlaylib.tree_files(pristine)))


def _apply_patch(tree, patch_text):
    """Applies a -p1 unified diff to a tree: GNU patch, else whatthepatch."""
    if not patch_text:
        return  # An empty overlay; GNU patch would call it garbage.
    if shutil.which("patch"):
        subprocess.run(
            [
                "patch",
                "-p1",
                "--batch",
                "--forward",
                "--silent",
                "-d",
                str(tree),
            ],
            input=patch_text,
            text=True,
            check=True,
        )
        return
    import whatthepatch

    for diff in whatthepatch.parse_patch(patch_text):
        path = Path(tree) / diff.header.new_path.removeprefix("b/")
        old = path.read_text().split("\n")[:-1] if path.exists() else []
        new = whatthepatch.apply_diff(diff, old) if diff.changes else old
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(line + "\n" for line in new))


def _py_files(root):
    return {rel for rel in overlaylib.tree_files(root) if rel.endswith(".py")}


def _requires_dist(metadata):
    return sorted(metadata.get_all("Requires-Dist") or [])


def test_version_and_metadata_match_upstream(pristine):
    ours = importlib.metadata.metadata("keras")
    upstream = importlib.metadata.Distribution.at(
        pristine / f"keras-{UPSTREAM_VERSION}.dist-info"
    ).metadata
    assert importlib.metadata.version("keras") == "3.15.1+torchdist"
    assert ours["Version"] == PROJECT["version"]
    plain = [r for r in _requires_dist(ours) if "extra ==" not in r]
    assert plain == _requires_dist(upstream)
    assert sorted(ours.get_all("Provides-Extra")) == sorted(
        PROJECT["optional-dependencies"]
    )
    for field in ("Requires-Python", "Summary", "License", "Name"):
        assert ours[field] == upstream[field], field


def test_overlay_files_are_installed(pristine, installed, tmp_path):
    new, diffs = _overlay(pristine)
    for rel in new:
        assert (installed / rel).read_bytes() == (REPO / rel).read_bytes(), rel
    for target, diff in diffs.items():
        # Upstream + the stored diff, applied independently of the build.
        tree = tmp_path / diff.replace("/", "_")
        (tree / target).parent.mkdir(parents=True)
        shutil.copyfile(pristine / target, tree / target)
        _apply_patch(tree, (REPO / diff).read_text())
        assert (installed / target).read_bytes() == (
            tree / target
        ).read_bytes(), diff


def test_export_reproduces_installed_tree(pristine, installed, tmp_path):
    patch_file = tmp_path / "change.diff"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "overlay.py"),
            "export",
            "-o",
            str(patch_file),
        ],
        check=True,
    )
    shutil.copytree(pristine / "keras", tmp_path / "tree" / "keras")
    _apply_patch(tmp_path / "tree", patch_file.read_text())
    rebuilt, ours = tmp_path / "tree", installed
    assert _py_files(rebuilt) == _py_files(ours)
    different = [
        rel
        for rel in sorted(_py_files(ours))
        if (rebuilt / rel).read_bytes() != (ours / rel).read_bytes()
    ]
    assert different == []


def _fake_upstream(root, lines=30):
    """Writes a small upstream tree: keras/src/foo.py with numbered lines."""
    text = "".join(f"line_{i} = {i}\n" for i in range(1, lines + 1))
    overlaylib.write_text(root / "keras" / "src" / "foo.py", text)
    return text


def _two_hunk_diff(second_context="line_20 = 20"):
    """A diff of keras/src/foo.py changing lines 3 and 21."""
    return (
        "--- a/keras/src/foo.py\n+++ b/keras/src/foo.py\n"
        "@@ -2,3 +2,3 @@\n line_2 = 2\n-line_3 = 3\n+line_3 = 'three'\n"
        " line_4 = 4\n"
        "@@ -20,3 +20,4 @@\n"
        f" {second_context}\n line_21 = 21\n+extra = 1\n line_22 = 22\n"
    )


def test_diff_and_new_module_build(tmp_path):
    upstream, source = tmp_path / "upstream", tmp_path / "source"
    text = _fake_upstream(upstream)
    overlaylib.write_text(
        source / "keras" / "src" / "foo.py.diff", _two_hunk_diff()
    )
    overlaylib.write_text(source / "keras" / "src" / "bar.py", "BAR = 1\n")
    overlaylib.build_tree(source, upstream, tmp_path / "out")
    expected = text.replace("line_3 = 3\n", "line_3 = 'three'\n").replace(
        "line_21 = 21\n", "line_21 = 21\nextra = 1\n"
    )
    assert (tmp_path / "out/keras/src/foo.py").read_text() == expected
    assert (tmp_path / "out/keras/src/bar.py").read_text() == "BAR = 1\n"


def test_corrupted_diff_names_file_and_hunk(tmp_path):
    upstream, source = tmp_path / "upstream", tmp_path / "source"
    _fake_upstream(upstream)
    overlaylib.write_text(
        source / "keras" / "src" / "foo.py.diff",
        _two_hunk_diff(second_context="line_20 = 'changed upstream'"),
    )
    with pytest.raises(overlaylib.OverlayError) as error:
        overlaylib.build_tree(source, upstream, tmp_path / "out")
    message = str(error.value)
    assert "keras/src/foo.py.diff" in message
    assert "hunk 2" in message and "@@ -20,3 +20,4 @@" in message
    assert not (tmp_path / "out" / "keras").exists()


def test_overlay_copy_of_upstream_file_is_refused(tmp_path):
    upstream, source = tmp_path / "upstream", tmp_path / "source"
    text = _fake_upstream(upstream)
    overlaylib.write_text(source / "keras" / "src" / "foo.py", text + "x = 1\n")
    refusal = r"carry the change as keras/src/foo\.py\.diff"
    with pytest.raises(overlaylib.OverlayError, match=refusal):
        overlaylib.build_tree(source, upstream, tmp_path / "out")


def test_edit_then_save_makes_the_diff(pristine, tmp_path):
    root = tmp_path / "repo"
    (root / "keras").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", root)
    (root / "build").mkdir()
    (root / "build" / "upstream").symlink_to(REPO / "build" / "upstream")
    rel = "keras/src/backend/torch/core.py"

    def tool(*args):
        subprocess.run(
            [
                sys.executable,
                str(REPO / "tools" / "overlay.py"),
                "--root",
                str(root),
                *args,
            ],
            check=True,
            capture_output=True,
        )

    tool("edit", rel)
    edited = root / "build" / "edit" / rel
    assert edited.read_bytes() == (pristine / rel).read_bytes()
    text = edited.read_text()
    edited.write_text(text.replace("import os\n", "import os  # ours\n", 1))
    tool("save", rel)
    assert "+import os  # ours" in (root / f"{rel}.diff").read_text()
    overlaylib.build_tree(root, pristine, tmp_path / "out")
    assert (tmp_path / "out" / rel).read_text() == edited.read_text()


def _code_lines(text):
    # Blank lines say nothing about copying, and every file has many.
    return [line for line in text.splitlines() if line.strip()]


def test_no_new_module_is_a_near_copy_of_upstream(pristine):
    new, _ = _overlay(pristine)
    upstream = {
        rel: _code_lines(overlaylib.read_text(pristine / rel))
        for rel in _py_files(pristine)
    }
    copies = []
    for rel in (rel for rel in new if rel.endswith(".py")):
        ours = _code_lines(overlaylib.read_text(REPO / rel))
        # Tiny files (an __init__.py, say) share boilerplate by chance.
        if len(ours) < 20:
            continue
        for name, theirs in upstream.items():
            matcher = difflib.SequenceMatcher(
                None, ours, theirs, autojunk=False
            )
            if matcher.real_quick_ratio() > 0.5 and matcher.quick_ratio() > 0.5:
                copies.append(f"{rel} ~ {name} ({matcher.quick_ratio():.2f})")
    assert copies == []


def test_overlay_table_lists_every_diff_with_its_size(pristine):
    """keras/OVERLAY.md names each diff once, with its +/- line counts."""
    _, diffs = _overlay(pristine)
    table = (REPO / overlaylib.OVERLAY_DOC).read_text()
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`keras/"):
            rows[cells[0].strip("`")] = cells[1]
    assert sorted(rows) == sorted(diffs)
    for target, diff_rel in diffs.items():
        body = (REPO / diff_rel).read_text().splitlines()
        added = sum(
            1 for x in body if x.startswith("+") and not x.startswith("+++")
        )
        removed = sum(
            1 for x in body if x.startswith("-") and not x.startswith("---")
        )
        assert rows[target] == f"+{added} -{removed}", target


def test_overlay_table_is_neither_built_nor_exported(pristine):
    new, _ = _overlay(pristine)
    assert overlaylib.OVERLAY_DOC not in new
    assert "OVERLAY.md" not in overlaylib.export_patch(REPO, pristine)
