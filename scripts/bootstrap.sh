# Shared setup of run_multi_gpu.sh and run_tests.sh; source it, then call
# bootstrap_venv. It makes sure that the project's virtualenv exists, has
# torch, and has this package installed from the current sources:
#
#   - the venv is $KERAS_VENV (default: <repo>/.venv), made with
#     ${KERAS_PYTHON:-python3} (>= 3.11, as Keras 3.15.1 needs);
#     KERAS_VENV_SYSTEM_SITE_PACKAGES=1 lets it see the base Python's
#     packages, e.g. a CUDA torch that a GPU machine already has;
#   - torch is installed only when absent, with the constraints file
#     constraints/ci.txt (torch==2.13.0) when CI=true or when
#     KERAS_TORCH_CONSTRAINTS is unset, else with the file that it names;
#     never a bare `pip install torch`, which pulls GBs of CUDA;
#   - the package is (re)installed with a regular `pip install .` only when
#     keras/, build_backend/ or pyproject.toml changed since the last install
#     (their hash is kept in $KERAS_VENV/.keras-overlay-hash);
#   - KERAS_BASE=nightly builds it on the Keras master nightly that
#     pyproject.toml pins (`[tool.keras-torchdist] nightly-base`), with
#     `pip install -C base=...`, in its own venv (default <repo>/.venv-nightly).
#
# Sets REPO_ROOT, VENV and PY (the venv's python). pip's output goes to
# stderr so that the launched program owns stdout.

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${KERAS_BASE:-}" in
  "" | default) KERAS_BASE_REQUIREMENT="" ;;
  nightly)
    KERAS_BASE_REQUIREMENT="$(sed -n 's/^nightly-base = "\(.*\)"$/\1/p' \
      "$REPO_ROOT/pyproject.toml")"
    ;;
  *)
    echo "[bootstrap] KERAS_BASE must be 'default' or 'nightly'." \
      "Received: KERAS_BASE=$KERAS_BASE" >&2
    return 1
    ;;
esac
if [[ -n "$KERAS_BASE_REQUIREMENT" ]]; then
  VENV="${KERAS_VENV:-$REPO_ROOT/.venv-nightly}"
else
  VENV="${KERAS_VENV:-$REPO_ROOT/.venv}"
fi
PY="$VENV/bin/python"

bootstrap_log() { echo "[bootstrap] $*" >&2; }

# Hash of everything that goes into the built package.
overlay_hash() {
  (cd "$REPO_ROOT" &&
    find keras build_backend pyproject.toml -type f \
      ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 |
    LC_ALL=C sort -z | xargs -0 sha256sum |
    { cat; echo "base $KERAS_BASE_REQUIREMENT"; } | sha256sum | cut -d' ' -f1)
}

torch_constraints() {
  if [[ "${CI:-}" == "true" || -z "${KERAS_TORCH_CONSTRAINTS:-}" ]]; then
    echo "$REPO_ROOT/constraints/ci.txt"
  else
    echo "$KERAS_TORCH_CONSTRAINTS"
  fi
}

bootstrap_venv() {
  mkdir -p "$VENV"
  # Several runs may share one checkout: one of them sets the venv up at a
  # time. The lock is let go before the program runs (its children may
  # bootstrap too).
  local lock status=0
  exec {lock}>"$VENV/.bootstrap.lock"
  flock "$lock"
  _bootstrap_locked || status=$?
  exec {lock}>&-
  return "$status"
}

_bootstrap_locked() {
  if [[ ! -x "$PY" ]]; then
    local base="${KERAS_PYTHON:-python3}"
    if ! "$base" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      bootstrap_log "$base is older than Python 3.11; set KERAS_PYTHON"
      return 1
    fi
    bootstrap_log "creating $VENV with $base"
    "$base" -m venv ${KERAS_VENV_SYSTEM_SITE_PACKAGES:+--system-site-packages} \
      "$VENV" >&2 || return 1
  fi
  if ! "$PY" -c 'import importlib.util as u, sys; sys.exit(not u.find_spec("torch"))'; then
    local constraints
    constraints="$(torch_constraints)"
    bootstrap_log "installing torch (constraints: $constraints)"
    "$PY" -m pip install -q -c "$constraints" torch >&2 || return 1
  fi
  local want
  want="$(overlay_hash)"
  if [[ "$(cat "$VENV/.keras-overlay-hash" 2>/dev/null)" != "$want" ]]; then
    local base_setting=()
    if [[ -n "$KERAS_BASE_REQUIREMENT" ]]; then
      base_setting=(-C "base=$KERAS_BASE_REQUIREMENT")
    fi
    bootstrap_log "installing keras with our overlay" \
      "(pip install ${base_setting[*]} $REPO_ROOT)"
    "$PY" -m pip install -q "${base_setting[@]}" "$REPO_ROOT" >&2 || return 1
    echo "$want" >"$VENV/.keras-overlay-hash"
  fi
}
