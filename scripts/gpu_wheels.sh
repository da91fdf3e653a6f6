#!/usr/bin/env bash
# Fill .gpu-wheels/ with the wheels scripts/gpu_check.sh installs where a package is missing
# (a GPU machine with Python 3.12 and no package index).  Usage: scripts/gpu_wheels.sh [PYVER]
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:-3.12}
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .gpu-wheels "blake3==1.0.11"
ls -l .gpu-wheels
