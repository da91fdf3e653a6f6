#!/usr/bin/env bash
# Fill .gpu-wheels/ with what a GPU machine with no package index lacks (Python 3.12,
# torch, numpy, msgpack, fsspec, transformers; no Ray, no blake3).  Ignored by git, carried
# with the checkout (at most 64 MiB there).
#
#   bash scripts/gpu_wheels.sh [PYVER]          # blake3 for scripts/gpu_check.sh (0.4 MB)
#   bash scripts/gpu_wheels.sh --job [PYVER]    # and Ray for scripts/gpu_job_check.sh
#
# --job: Ray's wheel is 79 MB (201 MB unpacked).  The RL job needs only its core: this
# unpacks the wheel, leaves out the Java jars, RLlib, Data, Serve, Train, Tune, the LLM
# library and the dashboard's web client, and packs the rest with xz -9 into
# .gpu-wheels/job/ray-core.tar.xz (about 20 MB; about a minute on 2 cores), beside the
# wheels of Ray's own dependencies the GPU machine lacks (click, jsonschema, protobuf,
# psutil, pyyaml, requests: about 2 MB).  scripts/gpu_job_check.sh unpacks them into a
# private directory on arrival.
set -euo pipefail
cd "$(dirname "$0")/.."
JOB=0
if [ "${1:-}" = --job ]; then JOB=1; shift; fi
PYVER=${1:-3.12}
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
download() {
  "$PY" -m pip download -q --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 "$@"
}
download --no-deps -d .gpu-wheels "blake3==1.0.11"
if [ $JOB = 1 ]; then
  RAY_VERSION=$("$PY" -c "import importlib.metadata as m; print(m.version('ray'))")
  mkdir -p .gpu-wheels/job
  download -d .gpu-wheels/job click jsonschema "protobuf>=3.20.3" psutil pyyaml requests \
    "blake3==1.0.11"
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/rc-gpu-wheels.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
  download --no-deps -d "$WORK" "ray==$RAY_VERSION"
  mkdir "$WORK/x"
  # unpacked keeping each file's mode (raylet and gcs_server are executables)
  "$PY" - "$WORK"/ray-*.whl "$WORK/x" <<'PYEOF'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        path = z.extract(info, sys.argv[2])
        mode = info.external_attr >> 16
        if mode and not info.is_dir():
            os.chmod(path, mode & 0o777)
PYEOF
  (cd "$WORK/x/ray" && rm -rf jars rllib data serve train tune llm dashboard/client/build)
  tar -C "$WORK/x" -cf - . | xz -9 -T0 > .gpu-wheels/job/ray-core.tar.xz
  echo "ray $RAY_VERSION core for Python $PYVER: $(du -h .gpu-wheels/job/ray-core.tar.xz | cut -f1)"
fi
du -sh .gpu-wheels
ls -lR .gpu-wheels
