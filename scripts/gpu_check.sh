#!/usr/bin/env bash
# The prepared check of the save path on a GPU machine; no Ray needed (see bench/gpu_check.py).
#
#   bash scripts/gpu_check.sh OUT_DIR           # on a machine with a CUDA device (~4 min)
#   bash scripts/gpu_check.sh --full OUT_DIR    # adds the 16 GB per rank stall leg (~7 min)
#   bash scripts/gpu_check.sh --cpu OUT_DIR     # the CPU leg (CI runs it)
#   bash scripts/gpu_check.sh --help            # the legs, what each measures, expected times
#
# Needs python with torch, numpy, msgpack and fsspec: nothing else, nothing carried.
# Without the blake3 package the check writes sha256 checksums and says so; where
# .gpu-wheels/ holds its wheel (made on a machine with an index by scripts/gpu_wheels.sh;
# ignored by git, carried with the checkout) it is installed into a private directory,
# never into the machine's environment, and BLAKE3 is used.  Writes OUT_DIR/gpu_check.json
# after every leg and prints the table at the end; each leg has its own timeout, and no
# leg starts after the run's deadline, so the run ends within about 5 minutes (--full 10).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
if "$PY" -c "import blake3" 2>/dev/null; then :
elif compgen -G ".gpu-wheels/*.whl" > /dev/null; then
  SITE=$(mktemp -d /tmp/rc-gpu-site.XXXXXX)
  trap 'rm -rf "$SITE"' EXIT
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    .gpu-wheels/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_check: installed .gpu-wheels/ into $SITE" >&2
else
  echo "gpu_check: no blake3 here and no wheel in .gpu-wheels/: checksums with sha256" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# a safety net only: the check keeps its own deadline and writes its report on SIGTERM
FULL=0
for a in "$@"; do [ "$a" = --full ] && FULL=1; done
LIMIT=$([ $FULL = 1 ] && echo 590 || echo 330)
set +e
timeout -k 15 $LIMIT "$PY" -m bench.gpu_check "$@"
rc=$?
[ $rc = 124 ] && echo "gpu_check: stopped after $LIMIT s; OUT_DIR/gpu_check.json holds the legs it reached" >&2
exit $rc
