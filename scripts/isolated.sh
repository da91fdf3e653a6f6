#!/usr/bin/env bash
# Run a command where only loopback exists, when this machine allows it.
#
# A Ray head binds every interface; inside a fresh network namespace only 127.0.0.1
# exists, and with a PID namespace every process the command starts (Ray's GCS, raylet,
# workers, the S3 server) ends with it.  HOME is a fresh directory so Ray's token file
# (~/.ray/auth_token) of the user is neither read nor written.
set -euo pipefail
export HOME="$(mktemp -d "${TMPDIR:-/tmp}/raycheckpoint-home.XXXXXX")"
trap 'rm -rf "$HOME"' EXIT
if unshare --net --pid --mount --fork --mount-proc true 2>/dev/null; then
  unshare --net --pid --mount --fork --mount-proc bash -c 'ip link set lo up && exec "$@"' _ "$@"
else
  echo "note: no network namespace available here; running on the host network" >&2
  "$@"
fi
