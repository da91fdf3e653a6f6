#!/usr/bin/env bash
# Build .venv-verl: a fresh environment holding verl and this package, installed by ONE pip
# command (so pip must resolve both together), then `pip check`.  tests/test_beside_verl.py
# saves and loads a checkpoint in it (.ci/run builds it before the long tests; the tests run
# without network, so the environment is built here).  verl's trainer modules import four
# packages its own requirements leave out (transferqueue, cachetools, uvicorn, fastapi:
# verl's extras bring them); they are installed with it, so that the tests can run verl's
# trainer methods.  Usage: scripts/verl_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VERL_VERSION=${VERL_VERSION:-0.9.1}
ENV=.venv-verl
rm -rf "$ENV"
"${PYTHON:-python3}" -m venv "$ENV"
"$ENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir \
  -c scripts/constraints.txt "verl==$VERL_VERSION" "transferqueue>=0.1.10" cachetools uvicorn \
  fastapi .
"$ENV/bin/python" -m pip check
echo "$ENV: verl $VERL_VERSION beside raycheckpoint"
