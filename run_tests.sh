#!/usr/bin/env bash
# Runs the test suite: sets up .venv (torch, this package installed as a
# regular wheel, the test tools of the `test` extra), checks our Python files
# with ruff (format and lint, configured in pyproject.toml), then runs
# `python -m pytest tests integration_tests ARGS...` (test paths in ARGS
# replace the two directories); pytest's exit code is the script's.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/bootstrap.sh"
bootstrap_venv
cd "$REPO_ROOT"

# The test tools are those of the `test` extra, plus packages installed
# without their dependencies; pip skips them when present.
mapfile -t test_deps < <("$PY" -c 'import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]))')
"$PY" -m pip install -q "${test_deps[@]}" >&2
mapfile -t no_deps < <("$PY" -c 'import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["tool"]["keras-torchdist"]["test-no-deps"]))')
"$PY" -m pip install -q --no-deps "${no_deps[@]}" >&2

# Our Python files only: the diffs to upstream files keep upstream's style.
"$VENV/bin/ruff" format --check --quiet . || {
  echo "run_tests.sh: run '$VENV/bin/ruff format .' to format" >&2
  exit 1
}
"$VENV/bin/ruff" check --quiet .

# Test paths among the arguments replace the default test directories.
targets=(tests integration_tests)
for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
    targets=()
    break
  fi
done

export KERAS_BACKEND=torch
# The slowest tests are listed, so that CI logs show where the time goes.
exec "$PY" -m pytest --durations=25 "${targets[@]}" "$@"
