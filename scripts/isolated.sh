#!/usr/bin/env bash
# Run a command where only loopback exists, when this machine allows it.
#
# A Ray head binds every interface; inside a fresh network namespace only 127.0.0.1
# exists, and with a PID namespace every process the command starts (Ray's GCS, raylet,
# workers, the S3 server) ends with it.
#
# Nothing of the machine's per-user or machine-wide state is read or written: HOME (Ray's
# token file ~/.ray/auth_token) and TMPDIR are fresh directories of this run, removed
# after it.  Ray's default temporary directory is $RAY_TMPDIR/ray, else $TMPDIR/ray, else
# /tmp/ray: with RAY_TMPDIR unset it is $TMPDIR/ray here, which does not exist, so a Ray
# instance started without a temporary directory of its own fails (or creates it, which
# fails the tests: tests/ray_temp_guard.py) instead of sharing another run's.  Inside the namespaces the
# machine's /tmp/ray, when there is one, is covered by an empty directory of this run:
# what other Ray instances keep there cannot leak in, and nothing leaks out to them.
#
# A driver's own local Ray (drivers/_ray.py) keeps its files under RAYCHECKPOINT_RAY_TMPDIR,
# and its reaper removes them once the driver is gone; here the PID namespace ends the
# reaper with the command, so that directory is one of this run's too, removed after it
# (under /tmp, short: Ray's socket paths must stay under 108 bytes).
set -euo pipefail
RUN="$(mktemp -d "${TMPDIR:-/tmp}/raycheckpoint-run.XXXXXX")"
RAYRUN="$(mktemp -d /tmp/rcr.XXXXXX)"
trap 'rm -rf "$RUN" "$RAYRUN"' EXIT
mkdir "$RUN/home" "$RUN/tmp" "$RUN/tmp-ray"
export HOME="$RUN/home" TMPDIR="$RUN/tmp"
export RAYCHECKPOINT_RAY_TMPDIR="${RAYCHECKPOINT_RAY_TMPDIR:-$RAYRUN}"
unset RAY_TMPDIR
if unshare --net --pid --mount --fork --mount-proc true 2>/dev/null; then
  unshare --net --pid --mount --fork --mount-proc bash -c '
    set -e
    ip link set lo up
    if [ -d /tmp/ray ]; then mount --bind "$1" /tmp/ray; fi
    shift
    exec "$@"' _ "$RUN/tmp-ray" "$@"
else
  echo "note: no network namespace available here; running on the host network" >&2
  "$@"
fi
