#!/usr/bin/env bash
# The RL job on one GPU, SIGKILLed and resumed (see bench/gpu_job_check.py): resumed ==
# straight, the stall of every save against a pinned copy, the GPU memory after the kill.
#
#   bash scripts/gpu_job_check.sh OUT_DIR          # on a machine with one CUDA device (~3 min)
#   bash scripts/gpu_job_check.sh --cpu OUT_DIR    # on cpu, a small model
#
# Needs Ray.  Where this Python cannot import it (the GPU machine: no Ray, no package
# index), carry .gpu-wheels/job/ (made by `bash scripts/gpu_wheels.sh --job` on a machine
# with an index: Ray's core, 20 MB, and the few wheels it and the job need): it is unpacked
# into a private directory here, never into the machine's environment.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
if ! "$PY" -c "import ray" 2>/dev/null; then
  if [ ! -f .gpu-wheels/job/ray-core.tar.xz ]; then
    echo "error: this Python has no Ray and .gpu-wheels/job/ray-core.tar.xz is not here:" \
         "make it with 'bash scripts/gpu_wheels.sh --job' where an index is reachable," \
         "and carry .gpu-wheels" >&2
    exit 2
  fi
  SITE=$(mktemp -d "${TMPDIR:-/tmp}/rc-gpu-job-site.XXXXXX")
  trap 'rm -rf "$SITE"' EXIT
  xz -dc .gpu-wheels/job/ray-core.tar.xz | tar -C "$SITE" -xf -
  # only what this Python lacks (a wheel never replaces an installed distribution)
  MISSING=$("$PY" - .gpu-wheels/job/*.whl <<'PYEOF'
import importlib.metadata as md, os, sys
for whl in sys.argv[1:]:
    try:
        md.version(os.path.basename(whl).split("-")[0])
    except md.PackageNotFoundError:
        print(whl)
PYEOF
)
  if [ -n "$MISSING" ]; then
    # shellcheck disable=SC2086
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" $MISSING
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -c "import ray; print('gpu_job_check: Ray', ray.__version__, 'from', ray.__file__)" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout -k 15 570 "$PY" -m bench.gpu_job_check "$@"
