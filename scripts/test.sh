#!/usr/bin/env bash
# Set up and run the test suite (the README's test command; .ci/run calls it).
# The tests start their own services (moto's S3 server on 127.0.0.1, a local Ray
# instance) and stop them; scripts/isolated.sh makes sure nothing outlives the run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# the cluster tests bring a Ray cluster up with `ray up` over ssh to 127.0.0.1: they need
# sshd and rsync (Debian packages); services are not started by the install (policy-rc.d)
if [ ! -x /usr/sbin/sshd ] || ! command -v rsync >/dev/null; then
  bash scripts/apt_install.sh /tmp/raycheckpoint-apt.log openssh-server rsync \
    || echo "note: could not install openssh-server/rsync; cluster tests will skip" >&2
fi
bash scripts/isolated.sh .venv/bin/python -m pytest "$@"
