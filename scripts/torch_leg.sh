#!/usr/bin/env bash
# The library's own save, load, reshard and DCP tests on another torch release, in a fresh
# environment (.venv-torch-VERSION) holding PyPI's regular build of that release (a CUDA
# build: it installs and runs on a CPU machine too).  pyproject.toml's torch range is what
# these legs pass: .ci/run runs 2.11.0 (the range's oldest, the GPU machine's); the newest,
# 2.15.0, passes it too, run by hand.
#   bash scripts/torch_leg.sh 2.15.0 [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: scripts/torch_leg.sh TORCH_VERSION [pytest args]}
shift
ENV=".venv-torch-$VERSION"
rm -rf "$ENV"
"${PYTHON:-python3}" -m venv "$ENV"
# every other package at the version the default suite runs with (.venv, from scripts/setup.sh):
# the leg changes torch alone, and pip's resolver has no s3fs/botocore backtracking to lose
bash scripts/setup.sh test
.venv/bin/python -m pip freeze --exclude-editable --disable-pip-version-check \
  | grep -viE '^(torch|triton|nvidia-|cuda-)' > "$ENV/same-as-default.txt"
# no machine-wide torch cap (PIP_CONSTRAINT): the release asked for
PIP_CONSTRAINT=/dev/null "$ENV/bin/python" -m pip install -q --disable-pip-version-check \
  --no-cache-dir -c "$ENV/same-as-default.txt" "torch==$VERSION" -e ".[job,test]"
"$ENV/bin/python" -c "import torch; print('torch', torch.__version__)"
TESTS=(tests/test_dcp_save.py tests/test_dcp_load.py tests/test_dcp_io.py tests/test_dcp_multi_file.py
       tests/test_save_load.py tests/test_save_failures.py
       tests/test_torch_records.py tests/test_state_dict_cache.py tests/test_worker_load.py)
# not the save protocol's own timing, retention and barrier tests: torch plays no part in them
PROTOCOL_ONLY="retention or persist_starts or freeze_their_heap or never_reads or barrier_timeout \
or rebuilt_from_markers"
bash scripts/isolated.sh "$ENV/bin/python" -m pytest -p no:cacheprovider "${TESTS[@]}" \
  -k "not ($PROTOCOL_ONLY)" "$@"
