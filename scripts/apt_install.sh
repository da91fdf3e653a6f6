#!/usr/bin/env bash
# apt_install.sh LOG PACKAGE...: install Debian packages the tests need (as root, with
# apt-get), output to LOG; no service is started by the install (policy-rc.d).  Exits
# non-zero when they could not be installed; the caller says what is skipped then.
set -uo pipefail
log=$1; shift
[ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || { echo "needs root and apt-get" > "$log"; exit 1; }
policy=/usr/sbin/policy-rc.d
added_policy=
if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; added_policy=1; fi
{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"; } > "$log" 2>&1
rc=$?
if [ -n "$added_policy" ]; then rm -f "$policy"; fi
exit $rc
