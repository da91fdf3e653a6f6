#!/usr/bin/env bash
# The prepared check of the save path on a GPU machine; no Ray needed (see bench/gpu_check.py).
#
#   bash scripts/gpu_check.sh OUT_DIR           # on a machine with a CUDA device
#   bash scripts/gpu_check.sh --cpu OUT_DIR     # the CPU leg (CI runs it)
#
# Needs python with torch, numpy, msgpack and fsspec.  Whatever else the save path imports
# and the machine lacks (blake3) is installed from the wheels in .gpu-wheels/ (made on a
# machine with an index by scripts/gpu_wheels.sh; ignored by git, carried with the checkout)
# into a private directory, never into the machine's environment.  Prints the table and
# writes OUT_DIR/gpu_check.json.  Ends within 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
if ! "$PY" -c "import blake3" 2>/dev/null && compgen -G ".gpu-wheels/*.whl" > /dev/null; then
  SITE=$(mktemp -d /tmp/rc-gpu-site.XXXXXX)
  trap 'rm -rf "$SITE"' EXIT
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    .gpu-wheels/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 480 "$PY" -m bench.gpu_check "$@"
