"""The change in upstream's layout, whole or as a reviewable series.

Used by ``tools/overlay.py export`` and ``check-series``; the plan is the
data file ``tools/export_plan.toml``:

* ``[tests]`` maps each of our test files and test support modules
  (``tests/X.py``) to its upstream path: a test beside the module it tests
  (``keras/src/backend/torch/distributed/fsdp/fsdp_test.py``), the support
  modules in one test-utils package (``keras/src/testing/torch_distribution/``).
  The export writes them there, their ``tests.X`` imports (and ``tests/X.py``
  mentions) rewritten to the new modules, each test module marked to run
  on the torch backend only (``torch_only``). ``[excluded]`` lists the test
  files left out, each with its reason; every file under ``tests/`` is in
  one of the two (``tests/test_packaging.py`` checks it).
* ``[[step]]`` is the series, in review order: each step a title, a commit
  message, the files it adds or changes (new modules, patched upstream files
  by their upstream path, test support modules by their ``tests/`` path) and
  its tests (``tests/`` paths, exported in that step); ``check`` optionally
  names the subset of them ``check-series`` runs.

Choices (also in tools/README.md, "Exporting the change"):

* Fixes of upstream logic that stand on their own come first, each a step
  with its test; one in a file that also carries hooks is an edit of the
  base's text (``[[step.edit]]``, ``fixed_texts``).
* Otherwise an upstream file changed for several reasons (the trainer's
  hooks, say) goes whole to one step, the first that needs it: its diff is
  small (at most a few dozen lines but for the trainer), and a hunk split
  would tie the series to the diffs' hunk layout, which changes with every
  edit.
* A file that serves several features (``distribution_lib.py`` composing
  the techniques, a hook file calling several) may come in parts: a
  ``[[step.part]]`` writes its final text ``without`` some blocks of it,
  each found once; the step listing the file adds the rest (``parts``).
* Steps follow the import graph: a file of step k imports (at module level
  or inside a function) only upstream modules or files of steps <= k;
  master's torch ``distribution_lib.py``, which ours replaces, counts as
  ours. ``import_order_errors`` checks it statically (AST).
* Tests stay pytest functions, as written: they take pytest fixtures
  (``tmp_path``, ``monkeypatch``, parametrized scenarios) and run their
  bodies on real ranks through the harness, which ``TestCase`` methods
  cannot receive; upstream runs its suite with pytest, which collects them
  as they are.
"""

import ast
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
import tomllib
from pathlib import Path

import overlaylib

PLAN = "tools/export_plan.toml"
TESTS_DIR = "tests"


def load_plan(root):
    """Reads ``tools/export_plan.toml``: ``tests``, ``excluded``, ``step``."""
    with open(Path(root) / PLAN, "rb") as f:
        plan = tomllib.load(f)
    plan.setdefault("tests", {})
    plan.setdefault("excluded", {})
    plan.setdefault("step", [])
    return plan


def test_files(root):
    """Our Python files under ``tests/`` (POSIX paths from the root)."""
    return sorted(
        p.relative_to(root).as_posix()
        for p in (Path(root) / TESTS_DIR).glob("*.py")
    )


def _dotted(path):
    """``keras/src/x.py`` -> ``keras.src.x``; a package's ``__init__``
    gives the package."""
    name = path[: -len(".py")].replace("/", ".")
    return name.removesuffix(".__init__")


def relocate(text, mapping):
    """Rewrites ``tests.X`` imports and mentions to the mapped modules.

    Args:
        text: a test file's text.
        mapping: ``{"tests/X.py": "keras/.../Y.py"}``.
    """
    modules = {
        Path(ours).stem: target
        for ours, target in mapping.items()
        if not ours.endswith("__init__.py")
    }

    def from_tests_import(match):
        indent, name, alias, rest = match.groups()
        if name not in modules:
            return match.group(0)
        target = modules[name]
        package, _, module = _dotted(target).rpartition(".")
        bound = alias or name
        suffix = f" as {bound}" if bound != module else ""
        return f"{indent}from {package} import {module}{suffix}{rest or ''}"

    text = re.sub(
        r"^(\s*)from tests import (\w+)(?: as (\w+))?([ \t]*#.*)?$",
        from_tests_import,
        text,
        flags=re.MULTILINE,
    )
    text = re.sub(
        r"(?<![\w./])tests/(\w+)\.py\b",
        lambda m: modules.get(m.group(1), m.group(0)),
        text,
    )
    return re.sub(
        r"(?<![\w./])tests\.(\w+)\b",
        lambda m: (
            _dotted(modules[m.group(1)])
            if m.group(1) in modules
            else m.group(0)
        ),
        text,
    )


def relocated_tests(root, plan):
    """``{upstream path: text}`` of every mapped test file; the test
    modules (``*_test.py``) marked as the torch backend's."""
    mapping = plan["tests"]
    relocated = {}
    for ours, target in mapping.items():
        text = relocate(overlaylib.read_text(Path(root) / ours), mapping)
        if target.endswith("_test.py"):
            text = torch_only(text, ours)
        relocated[target] = wrapped(text)
    return relocated


# Upstream's line length.
LINE_LENGTH = 80
_IMPORT = re.compile(r"^(\s*)from (\S+) import (\w+(?: as \w+)?)$")


def wrapped(text):
    """Wraps the lines that relocation made longer than ``LINE_LENGTH``.

    Relocated modules have longer names (``tests/harness.py`` becomes
    ``keras/src/testing/torch_distribution/harness.py``): a comment line
    and a docstring's line are wrapped at word boundaries (same indent,
    same comment marker), a ``from ... import name`` goes in parentheses.
    Other lines (code, other strings) are left as they are.

    Args:
        text: a module's text.

    Returns:
        The text, wrapped.
    """
    import textwrap

    docstring_lines = _docstring_lines(text)
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        if len(line) <= LINE_LENGTH:
            lines.append(line)
            continue
        body = line.lstrip()
        indent = line[: len(line) - len(body)]
        prefix = None
        if body.startswith("# "):
            prefix, body = indent + "# ", body[2:]
        elif number in docstring_lines:
            prefix = indent
        import_match = _IMPORT.match(line)
        if prefix is not None:
            lines.extend(
                textwrap.wrap(
                    body,
                    LINE_LENGTH,
                    initial_indent=prefix,
                    subsequent_indent=prefix,
                    break_long_words=False,
                    break_on_hyphens=False,
                )
            )
        elif import_match:
            indent, module, name = import_match.groups()
            lines += [
                f"{indent}from {module} import (",
                f"{indent}    {name},",
                f"{indent})",
            ]
        else:
            lines.append(line)
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def _docstring_lines(text):
    """The numbers of the lines of a module's, class' or function's
    docstring."""
    numbers = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and _is_docstring(body[0]):
            numbers.update(range(body[0].lineno, body[0].end_lineno + 1))
    return numbers


TORCH_ONLY = """
# Upstream runs its suite on every backend: these tests are the torch
# backend's.
pytestmark = pytest.mark.skipif(
    backend.backend() != "torch", reason="Tests the torch backend."
)
"""


def torch_only(text, name):
    """Marks a test module to run on the torch backend only: upstream's
    suite runs on every backend (``pytestmark`` after the imports, which
    gain ``pytest`` and ``keras.src.backend`` where they lack them, in
    isort's order).

    Args:
        text: the test module's text.
        name: its name, for errors.

    Returns:
        The marked text.

    Raises:
        ValueError: if the module binds ``backend`` or ``pytestmark``
            otherwise, or has no imports to follow.
    """
    tree = ast.parse(text)
    imports = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(node)
        elif imports or not _is_docstring(node):
            break
    if not imports:
        raise ValueError(f"{name}: no module-level imports to follow.")
    # A function's own import binds nothing at module level.
    bound = {
        alias.asname or alias.name.split(".")[0]
        for node in imports
        for alias in node.names
    }
    assigned = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    if "pytestmark" in bound | assigned or "backend" in assigned:
        raise ValueError(
            f"{name}: binds `backend` or `pytestmark`: mark it by hand."
        )
    lines = text.splitlines(keepends=True)
    wanted = [
        ("import pytest\n", (False, False, "pytest"), "pytest"),
        (
            "from keras.src import backend\n",
            (True, True, "keras.src"),
            "backend",
        ),
    ]
    end = max(node.end_lineno for node in imports)
    for line, key, binding in wanted:
        if binding not in bound:
            at, line = _import_position(imports, key, line)
            lines.insert(at, line)
            # One more item in `lines` before the imports after it.
            for node in imports:
                if node.lineno - 1 >= at:
                    node.lineno += 1
                    node.end_lineno += 1
            if at <= end:
                end += 1
    lines.insert(end, TORCH_ONLY)
    return "".join(lines)


def _is_docstring(node):
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)


def _import_position(imports, key, line):
    """Where an import line sorted by ``key`` goes, in isort's order
    (third-party, then first-party ``keras``, the sections a blank line
    apart; ``import x`` before ``from x import y``; then by module).

    Returns:
        ``(line index, line)``, the line with the blank line that keeps
        its section apart, if it starts one.
    """

    def key_of(node):
        if isinstance(node, ast.Import):
            name, is_from = node.names[0].name, False
        else:
            name, is_from = node.module or "", True
        return (name.split(".")[0] == "keras", is_from, name)

    keys = [key_of(node) for node in imports]
    before = [i for i, k in enumerate(keys) if k < key]
    if before and keys[before[-1]][0] == key[0]:
        return imports[before[-1]].end_lineno, line
    after = [i for i, k in enumerate(keys) if k > key]
    if after:
        first = imports[after[0]]
        apart = "\n" if keys[after[0]][0] != key[0] else ""
        return first.lineno - 1, line + apart
    return imports[-1].end_lineno, "\n" + line


def export_sections(root, upstream_root, variant, with_tests=True):
    """``{path: diff section}``: the overlay's, plus the relocated tests.

    Raises:
        OverlayError: a mapped test path exists upstream, or is also one of
            the overlay's files.
    """
    sections = overlaylib.export_sections(root, upstream_root, variant)
    if not with_tests:
        return sections
    upstream = set(overlaylib.tree_files(upstream_root))
    errors = []
    for target, text in relocated_tests(root, load_plan(root)).items():
        if target in upstream or target in sections:
            errors.append(f"{PLAN}: {target} exists already: map elsewhere")
        sections[target] = overlaylib.new_file_section(target, text)
    if errors:
        raise overlaylib.OverlayError("\n".join(errors))
    return dict(sorted(sections.items()))


def _exported_path(plan, rel):
    """A step's entry as an exported path (``tests/X.py`` mapped)."""
    return plan["tests"].get(rel, rel)


def series_steps(root, upstream_root, variant):
    """Splits the export into the plan's steps.

    A step's ``[[step.edit]]`` entries carry a fix of an upstream file as a
    patch of its own (``fixed_texts``); the step that lists the file later
    carries the rest of its change.

    Returns:
        A list of ``(step, {path: section})``, in the plan's order; every
        exported file is in exactly one step's ``files``.

    Raises:
        OverlayError: a file in no step or in several, a step's entry that
            is not in the export of any base, a step with no file, an edit
            that does not apply or is not part of the change.
    """
    plan = load_plan(root)
    sections = export_sections(root, upstream_root, variant)
    new_files, patched = overlaylib.patched_texts(root, upstream_root, variant)
    fixes, fixed = fixed_texts(plan, upstream_root, patched)
    final = dict(patched)
    final.update((p, overlaylib.read_text(Path(root) / p)) for p in new_files)
    upstream = set(overlaylib.tree_files(upstream_root))
    base = {
        p: overlaylib.read_text(Path(upstream_root) / p)
        for p in final
        if p in upstream and p not in fixed
    }
    partial, parted = parts(plan, final, {**base, **fixed})
    owner, errors, out = {}, [], []
    for number, step in enumerate(plan["step"], 1):
        entries = list(step.get("files", [])) + list(step.get("tests", []))
        chosen = dict(fixes.get(number, {}))
        chosen.update(partial.get(number, {}))
        for rel in entries:
            path = _exported_path(plan, rel)
            if path in owner:
                errors.append(
                    f"{path}: in step {owner[path]} and step {number}"
                )
                continue
            owner[path] = number
            earlier = parted.get(path, fixed.get(path))
            if earlier is not None:
                if earlier != final[path]:
                    chosen[path] = _section(path, earlier, final[path])
            elif path in sections:
                chosen[path] = sections[path]
            elif not _ours(root, plan, rel):
                errors.append(f"step {number}: {rel} is no file of ours")
        if not chosen:
            errors.append(f"step {number} ({step['title']}): no file here")
        out.append((step, chosen))
    for path in sections:
        if path not in owner:
            errors.append(f"{path}: exported, but in no step of {PLAN}")
    if errors:
        raise overlaylib.OverlayError("\n".join(errors))
    return out


def fixed_texts(plan, upstream_root, patched):
    """The fix steps' sections, and each fixed file's text after them.

    An edit (``file``, ``old``, ``new``) replaces the one ``old`` of the
    base's text (after earlier fixes) with ``new``; ``file`` may be a list
    of each base's path (the first this base patches is taken). Every line
    of ``new`` must be in the change's text of the file, so that a fix is
    part of the change and later steps do not undo it.

    Returns:
        ``({step number: {path: section}}, {path: text after the fixes})``.

    Raises:
        OverlayError: an edit whose file the base does not patch, whose
            ``old`` is not found exactly once, or whose lines the change
            does not have.
    """
    texts, fixes, errors = {}, {}, []
    for number, step in enumerate(plan["step"], 1):
        before = {}
        for edit in step.get("edit", []):
            paths = edit["file"]
            paths = [paths] if isinstance(paths, str) else paths
            path = next((p for p in paths if p in patched), None)
            if path is None:
                errors.append(f"step {number}: no base's file of {paths}")
                continue
            text = texts.get(path)
            if text is None:
                text = overlaylib.read_text(Path(upstream_root) / path)
            before.setdefault(path, text)
            found = text.count(edit["old"])
            if found != 1:
                errors.append(
                    f"step {number}: {path} has the edit's `old` text "
                    f"{found} times, not once"
                )
                continue
            missing = set(edit["new"].splitlines()) - set(
                patched[path].splitlines()
            )
            if missing:
                errors.append(
                    f"step {number}: {path}: the change lacks the edit's "
                    f"lines {sorted(missing)}"
                )
                continue
            texts[path] = text.replace(edit["old"], edit["new"])
        fixes[number] = {
            path: _section(path, text, texts.get(path, text))
            for path, text in before.items()
        }
    if errors:
        raise overlaylib.OverlayError("\n".join(errors))
    return fixes, texts


def parts(plan, final, before):
    """The part steps' sections, and each parted file's last part's text.

    A part (``file``, ``without``: a list of blocks) writes the file's
    ``final`` text with each block, found there once, left out (``file``
    may be a list of each base's path, as an edit's); the file's
    text before it is its last part's, its text ``before`` the series
    (upstream's, after the fix steps), or none (a new file).

    Returns:
        ``({step number: {path: section}}, {path: its last part's text})``.

    Raises:
        OverlayError: a part of a file that is not exported, or whose block
            is not in the file's final text exactly once.
    """
    texts, sections, errors = {}, {}, []
    for number, step in enumerate(plan["step"], 1):
        for part in step.get("part", []):
            path = _part_path(part, final)
            if path is None:
                errors.append(f"step {number}: a part of {part['file']}")
                continue
            for block in part["without"]:
                if final[path].count(block) != 1:
                    errors.append(
                        f"step {number}: {path} has a block `without` "
                        f"{final[path].count(block)} times, not once: "
                        f"{block.splitlines()[0]!r}"
                    )
            text = _without(final[path], part)
            old = texts.get(path, before.get(path))
            section = (
                overlaylib.new_file_section(path, text)
                if old is None
                else _section(path, old, text)
            )
            sections.setdefault(number, {})[path] = section
            texts[path] = text
    if errors:
        raise overlaylib.OverlayError("\n".join(errors))
    return sections, texts


def _part_path(part, texts):
    """The path of ``part``'s file that is in ``texts``, or ``None``."""
    paths = part["file"]
    paths = [paths] if isinstance(paths, str) else paths
    return next((p for p in paths if p in texts), None)


def _without(text, part):
    """``text`` without the blocks of ``part``."""
    for block in part["without"]:
        text = text.replace(block, "", 1)
    return text


def _section(path, old_text, new_text):
    """A file's diff section between two texts, as ``export_sections``."""
    return f"diff --git a/{path} b/{path}\n" + overlaylib.unified_diff(
        path, old_text, new_text
    )


def _ours(root, plan, rel):
    """Whether a step's entry names a file of ours on some base: a mapped
    test file, a new module, or an upstream file one of our diffs patches
    (a base that does not patch it exports nothing for it)."""
    if rel in plan["tests"]:
        return True
    root = Path(root)
    diffs = [rel + overlaylib.DIFF_SUFFIX]
    diffs += [f"{rel}.{v}{overlaylib.DIFF_SUFFIX}" for v in _variants()]
    return (root / rel).is_file() or any((root / d).is_file() for d in diffs)


def _variants():
    return [v for v in overlaylib.BASE_VARIANTS.values() if v]


def changed_lines(section):
    """``(added, removed)`` lines of one file's diff section."""
    lines = section.split("\n")
    added = sum(1 for x in lines if x.startswith("+") and x[:4] != "+++ ")
    removed = sum(1 for x in lines if x.startswith("-") and x[:4] != "--- ")
    return added, removed


def _slug(title):
    words = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-")
    return words[:52].rstrip("-")


def patch_name(number, step):
    return f"{number:04d}-{_slug(step['title'])}.patch"


def format_patch(number, total, step, sections):
    """One step as ``git format-patch`` writes it (``git am`` takes it)."""
    stat, added_all, removed_all = [], 0, 0
    for path, section in sections.items():
        added, removed = changed_lines(section)
        added_all += added
        removed_all += removed
        stat.append(f" {path} | +{added} -{removed}")
    message = step.get("message", "").strip()
    return "".join(
        [
            "From 0000000000000000000000000000000000000000 "
            "Mon Sep 17 00:00:00 2001\n",
            "From: keras-torchdist <keras-torchdist@example.invalid>\n",
            "Date: Thu, 1 Jan 2026 00:00:00 +0000\n",
            f"Subject: [PATCH {number}/{total}] {step['title']}\n\n",
            f"{message}\n\n" if message else "",
            "---\n",
            "\n".join(stat),
            f"\n {len(sections)} files changed, {added_all} insertions(+),"
            f" {removed_all} deletions(-)\n\n",
            *sections.values(),
            "-- \nkeras-torchdist\n\n",
        ]
    )


def write_series(root, upstream_root, variant, out_dir):
    """Writes ``NNNN-title.patch`` per step into ``out_dir``.

    Returns:
        A list of ``(file name, step, changed lines)``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("[0-9][0-9][0-9][0-9]-*.patch"):
        old.unlink()
    steps = series_steps(root, upstream_root, variant)
    written = []
    for number, (step, sections) in enumerate(steps, 1):
        name = patch_name(number, step)
        text = format_patch(number, len(steps), step, sections)
        overlaylib.write_text(out_dir / name, text)
        size = sum(sum(changed_lines(s)) for s in sections.values())
        written.append((name, step, size))
    return written


def _imports(text, module):
    """The dotted names a module imports (``from a import b`` gives ``a``
    and ``a.b``), at module level or in functions."""
    names = set()
    package = module.rpartition(".")[0]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(filter(None, parts + [base]))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_order_errors(root, upstream_root, variant):
    """Files that import a file of a later step (an empty list: none).

    A file's imports are read from its exported text (the patched text of
    an upstream file), and a part's from its text at its step; what the
    export adds or replaces as a whole counts as ours, a patched upstream
    module as upstream's.
    """
    plan = load_plan(root)
    steps = series_steps(root, upstream_root, variant)
    new_files, patched = overlaylib.patched_texts(root, upstream_root, variant)
    texts = {rel: overlaylib.read_text(Path(root) / rel) for rel in new_files}
    texts.update(patched)
    texts.update(relocated_tests(root, plan))
    ours = set(new_files) | set(plan["tests"].values())
    # A file's last step (its final text) and first (it exists from then).
    step_of, first_of = {}, {}
    for number, (_, sections) in enumerate(steps, 1):
        for path in sections:
            step_of[path] = number
            first_of.setdefault(path, number)
    by_module = {_dotted(p): p for p in ours if p.endswith(".py")}
    checks = [(path, number, texts[path]) for path, number in step_of.items()]
    for number, step in enumerate(plan["step"], 1):
        for part in step.get("part", []):
            path = _part_path(part, texts)
            checks.append((path, number, _without(texts[path], part)))
    errors = []
    for path, number, text in checks:
        if not path.endswith(".py"):
            continue
        module = _dotted(path)
        # A module needs its package: the package's __init__ if it is ours.
        names = _imports(text, module) | {module.rpartition(".")[0]}
        for name in sorted(names):
            target = by_module.get(name)
            if target and first_of.get(target, 0) > number:
                errors.append(
                    f"{path} (step {number}) imports {name} "
                    f"(step {first_of[target]})"
                )
    return errors


def parse_steps(text):
    """``"1,4-6"`` -> ``{1, 4, 5, 6}``; None -> None (every step)."""
    if not text:
        return None
    chosen = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        chosen.update(range(int(first), int(last or first) + 1))
    return chosen


def git_tree(upstream_root, dest):
    """``dest/keras``: the base's ``keras/``, committed in a git repository."""
    dest = Path(dest)
    shutil.copytree(Path(upstream_root) / "keras", dest / "keras")
    git = ["git", "-C", str(dest), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    return git


def step_pytest_args(plan, step):
    """The pytest arguments that run a step's ``check`` (else its tests),
    at their exported paths."""
    mapping = plan["tests"]
    args = []
    for item in step.get("check") or step.get("tests", []):
        for word in shlex.split(item):
            path, sep, node = word.partition("::")
            args.append(mapping.get(path, path) + sep + node)
    return args


def _summary(output):
    """pytest's last line, e.g. ``3 passed, 1 skipped in 12.3s``."""
    lines = [x.strip("= ") for x in output.strip().splitlines() if x.strip()]
    return lines[-1] if lines else "(no output)"


def check_series(root, upstream_root, variant, out_dir, python, only, timeout):
    """Writes the series, applies it step by step to the base's tree and
    runs each step's tests there (``PYTHONPATH`` at the tree, the torch
    backend). Prints and writes ``out_dir/check-series.md`` a table.

    Returns:
        Whether every step applied, imported and passed.
    """
    plan = load_plan(root)
    written = write_series(root, upstream_root, variant, out_dir)
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        git = git_tree(upstream_root, tree)
        env = dict(
            os.environ,
            PYTHONPATH=str(tree),
            KERAS_BACKEND="torch",
            OMP_NUM_THREADS="1",
        )
        for number, (name, step, size) in enumerate(written, 1):
            applied = subprocess.run(
                [*git, "apply", str(Path(out_dir).resolve() / name)],
                capture_output=True,
                text=True,
            )
            if applied.returncode:
                rows.append((number, step, size, "does not apply", 0.0))
                print(applied.stderr)
                ok = False
                break
            if only and number not in only:
                continue
            start = time.monotonic()
            modules = [
                _dotted(p)
                for p in _step_paths(plan, step)
                if p.endswith(".py") and (tree / p).exists()
            ]
            result = subprocess.run(
                [python, "-c", _IMPORT_ALL, *modules],
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
            )
            if result.returncode:
                outcome = "import failed: " + _summary(result.stderr)
            elif not step.get("tests"):
                outcome = f"imports ok ({len(modules)} modules); no tests"
            else:
                try:
                    result = subprocess.run(
                        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
                        + step_pytest_args(plan, step),
                        cwd=tree,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=timeout,
                    )
                    outcome = _summary(result.stdout)
                except subprocess.TimeoutExpired:
                    outcome, result = f"timed out after {timeout} s", None
            failed = result is None or result.returncode != 0
            if failed:
                ok = False
                print((result.stdout + result.stderr)[-3000:] if result else "")
            elapsed = time.monotonic() - start
            rows.append((number, step, size, outcome, elapsed))
            print(f"step {number}: {outcome} ({elapsed:.0f} s)", flush=True)
    table = [
        "| step | title | lines | tests run | result | time |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for number, step, size, outcome, elapsed in rows:
        run = " ".join(step_pytest_args(plan, step)) or "-"
        table.append(
            f"| {number} | {step['title']} | {size} | `{run}` | {outcome} "
            f"| {elapsed:.0f} s |"
        )
    text = "\n".join(table) + "\n"
    overlaylib.write_text(Path(out_dir) / "check-series.md", text)
    print(text)
    return ok


_IMPORT_ALL = (
    "import importlib, sys\n"
    "for name in sys.argv[1:]:\n"
    "    importlib.import_module(name)\n"
)


def _step_paths(plan, step):
    entries = list(step.get("files", [])) + list(step.get("tests", []))
    return [_exported_path(plan, rel) for rel in entries]
