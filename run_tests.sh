#!/usr/bin/env bash
# Runs the test suite: sets up .venv (torch, this package installed as a
# regular wheel, the test tools of the `test` extra), checks our Python files
# with ruff (format and lint, configured in pyproject.toml), then runs
# `python -m pytest tests integration_tests ARGS...` (test paths in ARGS
# replace the two directories); pytest's exit code is the script's.
#
# `./run_tests.sh --base nightly [ARGS...]` runs on the Keras master nightly
# that pyproject.toml pins instead, in .venv-nightly: the package built with
# `pip install -C base=...`, the tools of `nightly-test-deps` (no keras-hub:
# it does not import with the nightly, and its tests are skipped there), no
# linter (the default run has it), and by default the core tests listed in
# `nightly-tests` (what CI runs).
set -euo pipefail
args=()
base=default
while (($#)); do
  case "$1" in
    --base) base="${2:?--base needs a value: default or nightly}"; shift 2 ;;
    --base=*) base="${1#--base=}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
set -- "${args[@]+"${args[@]}"}"
export KERAS_BASE="$base"
source "$(dirname "${BASH_SOURCE[0]}")/scripts/bootstrap.sh"
bootstrap_venv
cd "$REPO_ROOT"

if [[ "$base" == nightly ]]; then
  mapfile -t test_deps < <("$PY" -c 'import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["tool"]["keras-torchdist"]["nightly-test-deps"]))')
  "$PY" -m pip install -q "${test_deps[@]}" >&2
  mapfile -t targets < <("$PY" -c 'import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["tool"]["keras-torchdist"]["nightly-tests"]))')
  for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
      targets=()
      break
    fi
  done
  export KERAS_BACKEND=torch
  exec "$PY" -m pytest --durations=10 "${targets[@]}" "$@"
fi

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
