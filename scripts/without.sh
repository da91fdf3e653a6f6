#!/usr/bin/env bash
# Run a command as if some Python packages were not installed: each named module's import
# fails (in the command and every Python process it starts), as on a machine that lacks it.
#
#   bash scripts/without.sh blake3,ray,cryptography -- bash scripts/gpu_check.sh --cpu OUT
#
# CI runs the GPU check this way: the GPU machine has no Ray, blake3, cryptography, s3fs
# or vLLM, and no package index to install them from.
set -euo pipefail
if [ $# -lt 3 ] || [ "$2" != "--" ]; then
  echo "usage: $0 MODULE[,MODULE...] -- COMMAND [ARGS...]" >&2
  exit 2
fi
HIDE=$(mktemp -d "${TMPDIR:-/tmp}/rc-without.XXXXXX")
trap 'rm -rf "$HIDE"' EXIT
IFS=, read -ra MODULES <<< "$1"
for m in "${MODULES[@]}"; do
  [[ "$m" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || { echo "$0: not a module name: $m" >&2; exit 2; }
  printf 'raise ImportError("%s is not installed here (hidden by scripts/without.sh)")\n' \
    "$m" > "$HIDE/$m.py"
done
shift 2
export PYTHONPATH="$HIDE${PYTHONPATH:+:$PYTHONPATH}"
"$@"
