#!/usr/bin/env bash
# Runs scripts/catalogue_sweep.py (the keras.layers catalogue under every
# distribution, as a table) in the project's venv, set up first as
# run_tests.sh sets it up: KERAS_VENV and KERAS_TORCH_CONSTRAINTS select a
# venv and the torch it gets (scripts/bootstrap.sh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
bootstrap_venv
cd "$REPO_ROOT"
export KERAS_BACKEND=torch
exec "$PY" scripts/catalogue_sweep.py "$@"
