#!/usr/bin/env bash
# The S3 tests against a second, real S3 server: Ceph's RADOS Gateway on 127.0.0.1
# (tests/rgw.py: one monitor, one in-memory OSD, radosgw; all ended by PID afterwards),
# inside the same private network namespace as the other tests.  Extra arguments go to
# pytest; by default every test marked s3 but the 200-save soak runs: the storage
# contract, save/load, corruption, lease, encryption, the crash matrix's S3 cases, the
# fault proxy, the CLI, the tiers and the whole RL job.  The soak (2 minutes here) runs
# against moto in the long tests; pass `-m s3` to run it against the gateway too.  .ci/run
# calls this after the long tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
have_ceph() {
  .venv/bin/python -c "import sys; from tests.rgw import missing_binaries; sys.exit(bool(missing_binaries()))"
}
# Debian's radosgw, ceph-mon and ceph-osd (Ceph 16, ~200 MB)
if ! have_ceph; then
  bash scripts/apt_install.sh /tmp/raycheckpoint-apt-ceph.log radosgw ceph-mon ceph-osd \
    || echo "note: could not install radosgw ceph-mon ceph-osd (see /tmp/raycheckpoint-apt-ceph.log)" >&2
fi
if ! have_ceph; then
  echo "SKIPPED: the S3 tests against Ceph's RADOS Gateway: radosgw, ceph-mon or ceph-osd is" \
       "missing and could not be installed (Debian packages; needs root and apt-get)"
  exit 0
fi
args=("$@")
if [ ${#args[@]} -eq 0 ]; then args=(-m "s3 and not soak"); fi
exec bash scripts/isolated.sh .venv/bin/python -m tests.rgw -- \
  .venv/bin/python -m pytest -p no:cacheprovider "${args[@]}"
