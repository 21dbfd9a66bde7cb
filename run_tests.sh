#!/usr/bin/env bash
# Runs the test suite: sets up .venv (torch, this package installed as a
# regular wheel, the test tools of the `test` extra), checks our Python files
# with ruff (format and lint, configured in pyproject.toml), then runs
# `python -m pytest tests integration_tests ARGS...` (test paths in ARGS
# replace the two directories). With no arguments at all (what CI runs,
# `.ci/run`), the core tests on the Keras master nightly follow (below).
# The exit code is the first failing run's, else 0.
#
# `./run_tests.sh --base nightly [ARGS...]` runs on the Keras master nightly
# that pyproject.toml pins instead, in .venv-nightly: the package built with
# `pip install -C base=...`, the tools of `nightly-test-deps` (no keras-hub:
# it does not import with the nightly, and its tests are skipped there), no
# linter (the default run has it), and by default the core tests listed in
# `nightly-tests`.
set -euo pipefail
run_all=$(( $# == 0 ))
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

# One list of `[tool.keras-torchdist]` (or `[project.optional-dependencies]`
# for `test`) in pyproject.toml, one item a line.
pyproject_list() {
  "$PY" -c 'import sys, tomllib
t = tomllib.load(open("pyproject.toml", "rb"))
table = t["project"]["optional-dependencies"] if sys.argv[1] == "test" else t["tool"]["keras-torchdist"]
print("\n".join(table[sys.argv[1]]))' "$1"
}

# Test paths among the arguments replace the default targets.
keep_default_targets() {
  for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
      return 1
    fi
  done
}

export KERAS_BACKEND=torch
if [[ "$base" == nightly ]]; then
  mapfile -t test_deps < <(pyproject_list nightly-test-deps)
  "$PY" -m pip install -q "${test_deps[@]}" >&2
  mapfile -t targets < <(pyproject_list nightly-tests)
  keep_default_targets "$@" || targets=()
  exec "$PY" -m pytest --durations=10 "${targets[@]}" "$@"
fi

# The test tools are those of the `test` extra, plus packages installed
# without their dependencies; pip skips them when present.
mapfile -t test_deps < <(pyproject_list test)
"$PY" -m pip install -q "${test_deps[@]}" >&2
mapfile -t no_deps < <(pyproject_list test-no-deps)
"$PY" -m pip install -q --no-deps "${no_deps[@]}" >&2

# Our Python files only: the diffs to upstream files keep upstream's style.
"$VENV/bin/ruff" format --check --quiet . || {
  echo "run_tests.sh: run '$VENV/bin/ruff format .' to format" >&2
  exit 1
}
"$VENV/bin/ruff" check --quiet .

targets=(tests integration_tests)
keep_default_targets "$@" || targets=()
# The slowest tests are listed, so that CI logs show where the time goes.
if ((run_all == 0)); then
  exec "$PY" -m pytest --durations=25 "${targets[@]}" "$@"
fi
status=0
# The nightly's venv is set up while the suite runs: pip waits on the disk
# more than on the CPUs. Its log is shown if that fails (the nightly run
# below then sets it up again, and fails in the open).
mkdir -p "$REPO_ROOT/build"
setup_log="$REPO_ROOT/build/nightly-setup.log"
(KERAS_BASE=nightly && source "$REPO_ROOT/scripts/bootstrap.sh" &&
  bootstrap_venv) >"$setup_log" 2>&1 &
nightly_setup=$!
"$PY" -m pytest --durations=25 "${targets[@]}" || status=$?
wait "$nightly_setup" || cat "$setup_log" >&2
nightly=0
"$REPO_ROOT/run_tests.sh" --base nightly || nightly=$?
if ((status == 0)); then
  status=$nightly
fi
exit "$status"
