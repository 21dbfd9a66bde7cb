"""The installed package is upstream Keras plus exactly our overlay.

Runs in the environment that run_tests.sh sets up (the package installed):
Keras 3.15.1 in `.venv`, the pinned Keras master nightly in `.venv-nightly`
(`run_tests.sh --base nightly`); the base is read from the installed
version. Pristine upstream is downloaded once into build/upstream/.
"""

import ast
import dataclasses
import difflib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "build_backend"))
sys.path.insert(0, str(REPO / "tools"))
import overlaylib  # noqa: E402
import series  # noqa: E402

PROJECT = overlaylib.project_table(REPO)
NIGHTLY = overlaylib.Base(
    tomllib.loads((REPO / "pyproject.toml").read_text())["tool"][
        "keras-torchdist"
    ]["nightly-base"]
)


BASE = overlaylib.base_of(REPO, importlib.metadata.version("keras"))


def _pristine(base):
    return overlaylib.pristine_upstream(
        base.version, REPO / "build" / "upstream", base.distribution
    )


@pytest.fixture(scope="session")
def pristine():
    """A root holding pristine upstream keras/ and its dist-info."""
    return _pristine(BASE)


@pytest.fixture(scope="session")
def pristine_nightly():
    """The pinned nightly base (`nightly-base` of pyproject.toml)."""
    return _pristine(NIGHTLY)


@pytest.fixture(scope="session")
def installed():
    """The root holding the imported keras package (regular or editable)."""
    spec = importlib.util.find_spec("keras")
    assert spec is not None and spec.origin, "keras is not installed"
    package = Path(spec.origin).parent
    assert package.resolve() != (REPO / "keras").resolve()
    return package.parent


def _overlay(pristine, variant=BASE.variant):
    """Returns (new files, {patched upstream path: diff path}) of the repo."""
    return overlaylib.read_overlay(
        REPO, set(overlaylib.tree_files(pristine)), variant
    )


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
        pristine / BASE.dist_info
    ).metadata
    assert importlib.metadata.version("keras") == f"{BASE.version}+torchdist"
    assert ours["Version"] == overlaylib.our_version(PROJECT, BASE)
    assert ours["Name"] == PROJECT["name"] == "keras"
    assert [r for r in _requires_dist(ours) if "extra ==" not in r] == [
        r for r in _requires_dist(upstream) if "extra ==" not in r
    ]
    # Upstream's extras (the nightly has `gcs`), then ours.
    assert sorted(ours.get_all("Provides-Extra")) == sorted(
        (upstream.get_all("Provides-Extra") or [])
        + list(PROJECT["optional-dependencies"])
    )
    for field in ("Requires-Python", "Summary", "License"):
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


def _export(requirement, patch_file):
    """Runs `tools/overlay.py export --base requirement -o patch_file`."""
    subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "overlay.py"),
            "export",
            "--base",
            requirement,
            "-o",
            str(patch_file),
        ],
        check=True,
    )
    return patch_file


def test_export_reproduces_installed_tree(pristine, installed, tmp_path):
    patch_file = _export(BASE.requirement, tmp_path / "change.diff")
    shutil.copytree(pristine / "keras", tmp_path / "tree" / "keras")
    _apply_patch(tmp_path / "tree", patch_file.read_text())
    rebuilt, ours = tmp_path / "tree", installed
    # The export adds our tests, in upstream's layout; the package has none.
    tests = set(series.load_plan(REPO)["tests"].values())
    assert _py_files(rebuilt) == _py_files(ours) | tests
    assert not _py_files(ours) & tests
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


def test_edit_then_save_makes_the_diff(tmp_path):
    pristine = _pristine(overlaylib.default_base(REPO))
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


def _size(diff_rel):
    """``+A -R``: the lines a diff adds and removes."""
    body = (REPO / diff_rel).read_text().splitlines()
    added = sum(
        1 for x in body if x.startswith("+") and not x.startswith("+++")
    )
    removed = sum(
        1 for x in body if x.startswith("-") and not x.startswith("---")
    )
    return f"+{added} -{removed}"


def test_overlay_table_lists_every_diff_with_its_size():
    """keras/OVERLAY.md names each diff once, with its +/- line counts:
    the plain diffs by their upstream file, each variant by its own path."""
    table = (REPO / overlaylib.OVERLAY_DOC).read_text()
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`keras/"):
            rows[cells[0].strip("`")] = cells[1]
    diffs = {}
    for rel in overlaylib.tree_files(REPO):
        if rel.endswith(overlaylib.DIFF_SUFFIX):
            target, variant = overlaylib.diff_target(rel)
            diffs[target if variant is None else rel] = rel
    assert sorted(rows) == sorted(diffs)
    for row, diff_rel in diffs.items():
        assert rows[row] == _size(diff_rel), row


def test_overlay_table_is_neither_built_nor_exported(pristine):
    new, _ = _overlay(pristine)
    assert overlaylib.OVERLAY_DOC not in new
    assert "OVERLAY.md" not in overlaylib.export_patch(
        REPO, pristine, BASE.variant
    )


def test_base_is_a_pinned_keras_requirement():
    base = overlaylib.Base("keras-nightly==3.16.0.dev2026102704")
    assert (base.distribution, base.version, base.variant) == (
        "keras-nightly",
        "3.16.0.dev2026102704",
        "nightly",
    )
    assert base.dist_info == "keras_nightly-3.16.0.dev2026102704.dist-info"
    assert overlaylib.default_base(REPO).requirement == "keras==3.15.1"
    for bad in ("keras", "keras>=3.15", "tensorflow==2.21.0"):
        with pytest.raises(overlaylib.OverlayError, match="Received: base="):
            overlaylib.Base(bad)


def test_variant_diff_replaces_the_plain_one_on_its_base(tmp_path):
    upstream, source = tmp_path / "upstream", tmp_path / "source"
    text = _fake_upstream(upstream)
    overlaylib.write_text(upstream / "keras" / "src" / "moved.py", "M = 1\n")
    src = source / "keras" / "src"
    overlaylib.write_text(src / "foo.py.diff", _two_hunk_diff())
    variant = _two_hunk_diff().replace("'three'", "'THREE'")
    overlaylib.write_text(src / "foo.py.nightly.diff", variant)
    # A diff of a file only 3.15.1 has, empty (dropped) on the variant base.
    overlaylib.write_text(src / "gone.py.diff", "not applied on nightly")
    overlaylib.write_text(src / "gone.py.nightly.diff", "")
    overlaylib.build_tree(source, upstream, tmp_path / "out", variant="nightly")
    out = (tmp_path / "out/keras/src/foo.py").read_text()
    assert "line_3 = 'THREE'" in out and "extra = 1" in out
    assert not (tmp_path / "out/keras/src/gone.py").exists()
    # On the default base the variants are ignored: gone.py must exist.
    with pytest.raises(overlaylib.OverlayError, match="no keras/src/gone.py"):
        overlaylib.build_tree(source, upstream, tmp_path / "out2")
    (src / "gone.py.diff").unlink()
    overlaylib.build_tree(source, upstream, tmp_path / "out2")
    assert (tmp_path / "out2/keras/src/foo.py").read_text() == text.replace(
        "line_3 = 3\n", "line_3 = 'three'\n"
    ).replace("line_21 = 21\n", "line_21 = 21\nextra = 1\n")


def test_replaced_module_only_where_listed(tmp_path, monkeypatch):
    upstream, source = tmp_path / "upstream", tmp_path / "source"
    _fake_upstream(upstream)
    overlaylib.write_text(source / "keras" / "src" / "foo.py", "OURS = 1\n")
    with pytest.raises(overlaylib.OverlayError, match="exists upstream"):
        overlaylib.build_tree(source, upstream, tmp_path / "out", variant="x")
    monkeypatch.setitem(overlaylib.REPLACED, "x", ("keras/src/foo.py",))
    overlaylib.build_tree(source, upstream, tmp_path / "out", variant="x")
    assert (tmp_path / "out/keras/src/foo.py").read_text() == "OURS = 1\n"
    patch = overlaylib.export_patch(source, upstream, variant="x")
    assert "--- a/keras/src/foo.py" in patch and "+OURS = 1" in patch


def test_hunks_apply_where_upstream_moved_them(tmp_path):
    text = "".join(f"line_{i} = {i}\n" for i in range(1, 31))
    moved = "".join(f"new_{i} = {i}\n" for i in range(5)) + text
    out = overlaylib.apply_diff(
        _two_hunk_diff(), moved, "keras/src/foo.py", "foo.py.diff"
    )
    assert out.startswith("new_0 = 0\n")
    assert "line_3 = 'three'\n" in out
    assert "line_21 = 21\nextra = 1\nline_22 = 22\n" in out


def test_overlay_builds_on_both_bases(pristine_nightly):
    """Every diff applies on 3.15.1 and on the pinned nightly, and no plain
    diff is used on the nightly for a file master moved or replaced."""
    default = _pristine(overlaylib.default_base(REPO))
    overlaylib.patched_texts(REPO, default, None)
    new, patched = overlaylib.patched_texts(REPO, pristine_nightly, "nightly")
    nightly_files = set(overlaylib.tree_files(pristine_nightly))
    replaced = set(new) & nightly_files
    assert replaced == set(overlaylib.REPLACED["nightly"])
    assert "keras/src/backend/torch/ops/core.py" in patched
    assert "keras/src/backend/torch/core.py" not in nightly_files


def _git_tree(pristine, tmp_path, name):
    """The base's keras/ committed in a git repository: the git command."""
    if not shutil.which("git"):
        pytest.fail("git is needed to check the export")
    return series.git_tree(pristine, tmp_path / name)


def test_nightly_export_applies_with_git(pristine_nightly, tmp_path):
    """`overlay.py export --base <nightly>` is a patch `git apply` takes on
    the nightly's source tree (its wheel's keras/, in a git repository), and
    the tests it carries in upstream's layout are collected there."""
    patch_file = _export(NIGHTLY.requirement, tmp_path / "change.diff")
    git = _git_tree(pristine_nightly, tmp_path, "keras-master")
    tree = tmp_path / "keras-master"
    subprocess.run([*git, "apply", "--check", str(patch_file)], check=True)
    subprocess.run([*git, "apply", str(patch_file)], check=True)
    ours = (REPO / "keras/src/backend/torch/distribution_lib.py").read_bytes()
    assert (
        tree / "keras/src/backend/torch/distribution_lib.py"
    ).read_bytes() == ours
    plan = series.load_plan(REPO)
    tests = sorted(
        path
        for ours, path in plan["tests"].items()
        if Path(ours).name.startswith("test_")
    )
    for path in plan["tests"].values():
        text = (tree / path).read_text()
        assert not re.search(r"^\s*(from|import) tests\b", text, re.M), path
    # Collected, not run: each test module imports in the patched tree.
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q"]
        + ["-p", "no:cacheprovider", *tests],
        cwd=tree,
        env=dict(os.environ, PYTHONPATH=str(tree), KERAS_BACKEND="torch"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert collected.returncode == 0, collected.stdout[-3000:]
    for path in tests:
        assert f"{path}::" in collected.stdout, path


def test_every_test_file_is_exported_or_excluded():
    """tools/export_plan.toml maps each file of tests/ to upstream's layout
    or leaves it out with a reason: a new test file is never dropped
    silently."""
    plan = series.load_plan(REPO)
    mapped, excluded = set(plan["tests"]), set(plan["excluded"])
    assert not mapped & excluded
    assert sorted(mapped | excluded) == series.test_files(REPO)
    assert all(reason.strip() for reason in plan["excluded"].values())
    targets = list(plan["tests"].values())
    assert len(set(targets)) == len(targets)
    for ours, target in plan["tests"].items():
        assert target.startswith("keras/src/") and target.endswith(".py")
        if Path(ours).name.startswith("test_"):
            assert target.endswith("_test.py"), target
    # Each mapped file is in one step of the series, with its importers.
    entries = [
        rel
        for step in plan["step"]
        for rel in step.get("files", []) + step.get("tests", [])
    ]
    assert sorted(rel for rel in entries if rel.startswith("tests/")) == (
        sorted(mapped)
    )


def test_relocated_imports():
    mapping = {
        "tests/harness.py": "keras/src/testing/x/harness.py",
        "tests/test_fsdp.py": "keras/src/a/fsdp_test.py",
    }
    text = (
        "from tests import harness\n"
        "from tests import harness as h  # noqa: E402\n"
        "from tests import test_fsdp\n"
        "from tests.harness import run_on_ranks\n"
        "from tests import other\n"
        "# see `tests/harness.py` and tests.harness; not tests/other.py\n"
    )
    assert series.relocate(text, mapping) == (
        "from keras.src.testing.x import harness\n"
        "from keras.src.testing.x import harness as h  # noqa: E402\n"
        "from keras.src.a import fsdp_test as test_fsdp\n"
        "from keras.src.testing.x.harness import run_on_ranks\n"
        "from tests import other\n"
        "# see `keras/src/testing/x/harness.py` and "
        "keras.src.testing.x.harness; not tests/other.py\n"
    )


def test_relocated_lines_are_wrapped_to_upstreams_length():
    long_path = "keras/src/testing/torch_distribution/" + "x" * 30 + ".py"
    text = (
        f'"""A module docstring that names `{long_path}` and more words."""\n'
        "\n"
        f"from keras.src.testing.torch_distribution.{'y' * 28} import name\n"
        "\n"
        "\n"
        "def f():\n"
        f"    # A comment that names `{long_path}` and then more.\n"
        f'    data = "{long_path} stays as it is, code and data alike"\n'
        "    return data\n"
    )
    wrapped = series.wrapped(text)
    ast.parse(wrapped)
    lines = wrapped.splitlines()
    original = text.splitlines()
    data = original[7]
    assert [line for line in lines if len(line) > series.LINE_LENGTH] == [data]
    # Prose is wrapped at word boundaries, the same words in order.
    docstring = lines[: lines.index("")]
    assert len(docstring) > 1
    assert " ".join(docstring).split() == original[0].split()
    comment = [line[6:] for line in lines if line.startswith("    # ")]
    assert len(comment) > 1
    assert " ".join(comment).split() == original[6][6:].split()
    start = lines.index(original[2].replace(" name", " ("))
    assert lines[start + 1 : start + 3] == ["    name,", ")"]


def test_exported_tests_run_on_the_torch_backend_only():
    # Upstream runs its suite on every backend.
    text = (
        '"""Doc."""\n\nimport os\n\nimport numpy as np\n\n'
        "from keras.src.testing.x.harness import run_on_ranks\n\n\n"
        "def test_x():\n    pass\n"
    )
    assert series.torch_only(text, "x") == (
        '"""Doc."""\n\nimport os\n\nimport numpy as np\nimport pytest\n\n'
        "from keras.src import backend\n"
        "from keras.src.testing.x.harness import run_on_ranks\n"
        + series.TORCH_ONLY
        + "\n\ndef test_x():\n    pass\n"
    )
    # After an import added as the last one.
    assert series.torch_only("import pytest\n\nimport keras\n", "x") == (
        "import pytest\n\nimport keras\nfrom keras.src import backend\n"
        + series.TORCH_ONLY
    )
    # An import inside a function binds nothing at module level.
    marked = series.torch_only(
        "import os\n\n\ndef f():\n    import pytest\n", "x"
    )
    assert "\nimport pytest\n" in marked.split("def f")[0], marked
    # Imports the module has already are not repeated.
    marked = series.torch_only(
        "import pytest\n\nfrom keras.src import backend\n", "x"
    )
    assert marked.count("import") == 2, marked
    with pytest.raises(ValueError, match="pytestmark"):
        series.torch_only("import pytest\n\npytestmark = 1\n", "x")
    exported = series.relocated_tests(REPO, series.load_plan(REPO))
    modules = [p for p in exported if p.endswith("_test.py")]
    assert modules
    for path in modules:
        namespace = {}
        # The marker itself, evaluated as the module would.
        tree = ast.parse(exported[path])
        marks = [
            node
            for node in tree.body
            if isinstance(node, ast.Assign)
            and getattr(node.targets[0], "id", None) == "pytestmark"
        ]
        assert len(marks) == 1, path
        imports = [
            node
            for node in tree.body
            if isinstance(node, (ast.Import, ast.ImportFrom))
        ]
        assert marks[0].lineno > max(n.lineno for n in imports), path
        # What the marker reads is bound by the module's own imports.
        bound = {a.asname or a.name for n in imports for a in n.names}
        assert {"pytest", "backend"} <= bound, path
        exec(
            "import pytest\nfrom keras.src import backend\n"
            + ast.unparse(marks[0]),
            namespace,
        )
        assert namespace["pytestmark"].args == (False,), path


def test_series_applies_step_by_step(pristine_nightly, tmp_path):
    """`overlay.py export --series DIR` on the nightly: each patch applies
    with git on the tree of the ones before; together they give the tree of
    the single export; every exported file is in exactly one step; a file
    imports only upstream modules and files of its step or earlier ones."""
    out = tmp_path / "series"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "overlay.py"),
            "export",
            "--base",
            NIGHTLY.requirement,
            "--series",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    patches = sorted(out.glob("*.patch"))
    plan = series.load_plan(REPO)
    assert [p.name for p in patches] == [
        series.patch_name(n, step) for n, step in enumerate(plan["step"], 1)
    ]
    git = _git_tree(pristine_nightly, tmp_path, "stepwise")
    for patch in patches:
        text = patch.read_text()
        assert text.startswith("From ") and "\nSubject: [PATCH " in text
        subprocess.run([*git, "apply", "--check", str(patch)], check=True)
        subprocess.run([*git, "apply", str(patch)], check=True)
    whole = _git_tree(pristine_nightly, tmp_path, "whole")
    patch_file = _export(NIGHTLY.requirement, tmp_path / "change.diff")
    subprocess.run([*whole, "apply", str(patch_file)], check=True)
    stepwise = overlaylib.tree_files(tmp_path / "stepwise")
    assert stepwise == overlaylib.tree_files(tmp_path / "whole")
    for rel in stepwise:
        assert (tmp_path / "stepwise" / rel).read_bytes() == (
            tmp_path / "whole" / rel
        ).read_bytes(), rel
    # Each file is one section of the single export, in one step; a file
    # that fix steps edit first has theirs too (applied in turn above).
    steps = series.series_steps(REPO, pristine_nightly, NIGHTLY.variant)
    by_path = {}
    for _, chosen in steps:
        for path, section in chosen.items():
            by_path.setdefault(path, []).append(section)
    exported = series.export_sections(REPO, pristine_nightly, NIGHTLY.variant)
    assert "".join(exported.values()) == patch_file.read_text()
    assert sorted(by_path) == sorted(exported)
    edited = {
        path
        for step in plan["step"]
        for edit in step.get("edit", [])
        for path in (
            [edit["file"]] if isinstance(edit["file"], str) else edit["file"]
        )
    }
    edited |= {
        path
        for step in plan["step"]
        for part in step.get("part", [])
        for path in (
            [part["file"]] if isinstance(part["file"], str) else part["file"]
        )
    }
    for path, sections in by_path.items():
        if path in edited:
            assert len(sections) >= 2, path
        else:
            assert sections == [exported[path]], path
    assert (
        series.import_order_errors(REPO, pristine_nightly, NIGHTLY.variant)
        == []
    )


def test_import_order_check_finds_a_late_module(tmp_path, monkeypatch):
    """A module of step 1 importing one of step 2 is reported."""
    upstream, source = tmp_path / "upstream", tmp_path / "source"
    _fake_upstream(upstream)
    overlaylib.write_text(
        source / "keras/src/a.py", "from keras.src import b\n"
    )
    overlaylib.write_text(source / "keras/src/b.py", "B = 1\n")
    overlaylib.write_text(
        source / series.PLAN,
        '[[step]]\ntitle = "a"\nfiles = ["keras/src/a.py"]\n'
        '[[step]]\ntitle = "b"\nfiles = ["keras/src/b.py"]\n',
    )
    errors = series.import_order_errors(source, upstream, None)
    assert errors == ["keras/src/a.py (step 1) imports keras.src.b (step 2)"]


def test_a_step_naming_no_file_of_ours_is_refused(tmp_path):
    upstream, source = tmp_path / "upstream", tmp_path / "source"
    _fake_upstream(upstream)
    overlaylib.write_text(source / "keras/src/a.py", "A = 1\n")
    overlaylib.write_text(
        source / series.PLAN,
        '[[step]]\ntitle = "a"\nfiles = ["keras/src/a.py", "keras/src/b.py"]\n',
    )
    with pytest.raises(overlaylib.OverlayError, match="b.py is no file"):
        series.series_steps(source, upstream, None)


def _fix_plan(source, old, new):
    """A plan whose first step fixes keras/src/foo.py (`old` -> `new`)."""
    edit = f"old = {json.dumps(old)}\nnew = {json.dumps(new)}\n"
    overlaylib.write_text(source / "keras/src/foo.py.diff", _two_hunk_diff())
    overlaylib.write_text(
        source / series.PLAN,
        '[[step]]\ntitle = "fix"\n[[step.edit]]\nfile = "keras/src/foo.py"\n'
        + edit
        + '[[step]]\ntitle = "rest"\nfiles = ["keras/src/foo.py"]\n',
    )


def test_a_fix_step_carries_its_edit_and_the_file_step_the_rest(tmp_path):
    upstream, source = tmp_path / "upstream", tmp_path / "source"
    _fake_upstream(upstream)
    _fix_plan(source, "line_3 = 3\n", "line_3 = 'three'\n")
    (fix, first), (rest, second) = series.series_steps(source, upstream, None)
    assert (fix["title"], rest["title"]) == ("fix", "rest")
    assert "+line_3 = 'three'" in first["keras/src/foo.py"]
    assert "extra" not in first["keras/src/foo.py"]
    assert "+extra = 1" in second["keras/src/foo.py"]
    assert "line_3" not in second["keras/src/foo.py"].split("@@")[-1]


@pytest.mark.parametrize(
    "old, new, error",
    [
        ("nowhere\n", "x = 1\n", "0 times, not once"),
        ("line_3 = 3\n", "line_3 = 4\n", "lacks"),
    ],
)
def test_a_fix_that_is_not_part_of_the_change_is_refused(
    tmp_path, old, new, error
):
    upstream, source = tmp_path / "upstream", tmp_path / "source"
    _fake_upstream(upstream)
    _fix_plan(source, old, new)
    with pytest.raises(overlaylib.OverlayError, match=error):
        series.series_steps(source, upstream, None)


def _part_plan(source, without):
    """A plan adding keras/src/a.py (importing keras/src/b.py) in parts: step
    1 writes it `without` blocks, step 2 adds b.py, step 3 the rest."""
    overlaylib.write_text(
        source / "keras/src/a.py",
        "A = 1\n\nfrom keras.src import b\n\nB = b.B\n",
    )
    overlaylib.write_text(source / "keras/src/b.py", "B = 2\n")
    part = f'file = "keras/src/a.py"\nwithout = {json.dumps(without)}\n'
    overlaylib.write_text(
        source / series.PLAN,
        '[[step]]\ntitle = "a"\n[[step.part]]\n'
        + part
        + '[[step]]\ntitle = "b"\nfiles = ["keras/src/b.py"]\n'
        '[[step]]\ntitle = "rest"\nfiles = ["keras/src/a.py"]\n',
    )


def test_a_part_step_writes_a_module_without_its_blocks(tmp_path):
    upstream, source = tmp_path / "upstream", tmp_path / "source"
    _fake_upstream(upstream)
    _part_plan(source, ["\nfrom keras.src import b\n", "\nB = b.B\n"])
    (_, first), (_, second), (_, rest) = series.series_steps(
        source, upstream, None
    )
    assert "new file mode" in first["keras/src/a.py"]
    assert "+A = 1" in first["keras/src/a.py"]
    assert "import b" not in first["keras/src/a.py"]
    assert list(second) == ["keras/src/b.py"]
    added = [x for x in rest["keras/src/a.py"].splitlines() if x[:1] == "+"]
    assert [x for x in added[1:] if x != "+"] == [
        "+from keras.src import b",
        "+B = b.B",
    ]
    # The part imports nothing of a later step; the whole file does, late.
    assert series.import_order_errors(source, upstream, None) == []
    _part_plan(source, ["\nB = b.B\n"])
    assert series.import_order_errors(source, upstream, None) == [
        "keras/src/a.py (step 1) imports keras.src.b (step 2)"
    ]


def test_a_part_whose_block_is_not_in_the_module_once_is_refused(tmp_path):
    upstream, source = tmp_path / "upstream", tmp_path / "source"
    _fake_upstream(upstream)
    _part_plan(source, ["nowhere\n"])
    with pytest.raises(overlaylib.OverlayError, match="0 times, not once"):
        series.series_steps(source, upstream, None)


_PRIVATE = re.compile(r"^_[a-z]\w*$")


def _private_uses(tree):
    """Private names a module reads or writes on another object than `self`
    or `cls`: attributes (not op names of `torch.ops`), `getattr`-style
    names, global attributes of Keras' `global_state` (quoted), and the
    private parts of module paths it imports or names a logger after."""
    uses = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _PRIVATE.match(node.attr):
            owner = ast.unparse(node.value)
            if owner not in ("self", "cls") and not (
                owner.startswith("torch.ops") or owner.endswith("aten")
            ):
                uses.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and node.module:
            uses.update(re.findall(r"(?<=\.)_\w+", node.module))
        elif isinstance(node, ast.Call) and node.args:
            function = getattr(node.func, "id", getattr(node.func, "attr", ""))
            named = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if function in ("getattr", "setattr", "hasattr"):
                uses.update(x for x in named if _PRIVATE.match(str(x)))
            elif function.endswith("_global_attribute"):
                uses.update(f'"{x}"' for x in named[:1])
            elif function == "getLogger":
                uses.update(re.findall(r"(?<=\.)_\w+", str(named[:1])))
    return uses


def _own_private_names(trees):
    """Private names our modules define: functions, classes, globals, and
    attributes they assign (on any object)."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in getattr(node, "targets", None) or [node.target]:
                    for leaf in ast.walk(target):
                        names.add(
                            getattr(leaf, "id", getattr(leaf, "attr", ""))
                        )
    return {x for x in names if _PRIVATE.match(x)}


def _upstream_private_names(pristine):
    """Private names upstream Keras defines: attributes it sets on `self`,
    its methods, its global attributes (quoted)."""
    names = set()
    for rel in _py_files(pristine):
        text = overlaylib.read_text(pristine / rel)
        names.update(re.findall(r"self\.(_[a-z]\w*)\s*(?::[^=\n]*)?=", text))
        names.update(re.findall(r"def (_[a-z]\w*)\(self", text))
        names.update(
            f'"{x}"'
            for x in re.findall(r'set_global_attribute\(\s*"(\w+)"', text)
        )
    return names


def _private_api_rows():
    """[(private names, modules)] of OVERLAY.md's private-API tables."""
    rows, section = [], False
    for line in (REPO / overlaylib.OVERLAY_DOC).read_text().splitlines():
        if line.startswith("## "):
            section = line.startswith("## Private")
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if section and len(cells) == 3 and "`" in cells[0]:
            names = set()
            for x in re.findall(r"`([^`]+)`", cells[0]):
                names.update(
                    [x]
                    if x.startswith('"')
                    else re.findall(r"(?:^|\.)(_\w+)", x)
                )
            rows.append((names, set(re.findall(r"`(\w+)`", cells[1]))))
    return rows


def test_private_apis_are_listed_where_used(pristine):
    """Each private name of Keras or torch that a module of ours uses is in a
    row of OVERLAY.md's private-API tables naming that module; each row's
    modules use its names."""
    new, _ = _overlay(pristine)
    trees = {
        Path(rel).stem: ast.parse(overlaylib.read_text(REPO / rel))
        for rel in new
        if rel.endswith(".py") and rel.startswith("keras/src/")
    }
    ours = _own_private_names(trees.values())
    upstream = _upstream_private_names(pristine)
    used = {
        (name, module)
        for module, tree in trees.items()
        for name in _private_uses(tree)
        if name not in ours or name in upstream
    }
    rows = _private_api_rows()
    unlisted = [
        use
        for use in sorted(used)
        if not any(use[0] in names and use[1] in ms for names, ms in rows)
    ]
    unused = [
        (sorted(names), module)
        for names, modules in rows
        for module in sorted(modules)
        if names and not any((name, module) in used for name in names)
    ]
    assert (unlisted, unused) == ([], [])


# The packages a technique lives in: the layer call and the step take them
# as plug-ins, set in `distribution_lib`, never by importing them.
TECHNIQUE_PACKAGES = (
    "keras.src.backend.torch.distributed.data_parallel",
    "keras.src.backend.torch.distributed.fsdp",
    "keras.src.backend.torch.distributed.tensor_parallel",
)


def test_the_layer_call_and_the_step_import_no_technique():
    from keras.src.backend.torch.distributed.training import compiled_step
    from keras.src.backend.torch.distributed.training import layer_call
    from keras.src.backend.torch.distributed.training import step

    for module in (layer_call, step, compiled_step):
        tree = ast.parse(inspect.getsource(module))
        imported = [
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        ] + [
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        ]
        assert not [
            name for name in imported if name.startswith(TECHNIQUE_PACKAGES)
        ], module.__name__


def test_distribution_lib_plugs_in_every_technique():
    from keras.src.backend.torch import distribution_lib
    from keras.src.backend.torch.distributed.training import layer_call
    from keras.src.backend.torch.distributed.training import step

    assert distribution_lib.layer_call is layer_call
    for module in (layer_call, step):
        defaults = module.Techniques()
        unset = [
            field.name
            for field in dataclasses.fields(defaults)
            if getattr(module.techniques, field.name)
            is getattr(defaults, field.name)
        ]
        assert unset == [], module.__name__
