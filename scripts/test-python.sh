#!/usr/bin/env bash
# Builds the Python package (maturin, through pip) into a venv and runs its
# pytest suite: quiesce.mooncake.TransferEngine against target processes.
# Usage: scripts/test-python.sh [pytest args]   (venv: $QUIESCE_VENV or .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${QUIESCE_VENV:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q ./python pytest numpy
"$venv/bin/python" -m pytest -q python/tests "$@"
