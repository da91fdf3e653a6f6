#!/usr/bin/env bash
# Set up and run the test suite (the README's test command; .ci/run calls it).
# The tests start their own services (moto's S3 server on 127.0.0.1, a local Ray
# instance) and stop them; scripts/isolated.sh makes sure nothing outlives the run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
bash scripts/isolated.sh .venv/bin/python -m pytest "$@"
