#!/usr/bin/env bash
# Create .venv and install raycheckpoint into it.  Usage: scripts/setup.sh [test]
# torch is pinned: an unpinned requirement can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" numpy
if [ "${1:-}" = "test" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
else
  .venv/bin/python -m pip install -q --disable-pip-version-check -e .
fi
