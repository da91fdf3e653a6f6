#!/usr/bin/env bash
# Set up and run the main job: train, crash (SIGKILL), resume, compare with a straight run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/isolated.sh .venv/bin/python -m drivers.demo "$@"
