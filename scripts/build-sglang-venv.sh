#!/usr/bin/env bash
# Build SGLang's own venv on the GPU node, on a LOCAL disk (the seed's imports hung on a network mount), from that
# version's lock: sglang-V.lock in deploy/sglang-locks/, every package pinned (scripts/lock-sglang-venv.sh writes it).
# Usage: scripts/build-sglang-venv.sh [/opt/sglang-venv]   (env SGLANG_VERSION, default 0.5.16)
# Then set Param server_command (or env DFLASH_SERVER_COMMAND) to: <venv>/bin/python -m sglang.launch_server
# Refuses, before it installs anything, a version without a lock and a glibc older than the lock's header names.
set -euo pipefail
VENV="${1:-/opt/sglang-venv}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.16}"  # supported 0.5.10-0.5.23 (include/dflash_regen/sglang/api.py); Qwen3.6 cookbook ran 0.5.16; 0.5.13/0.5.14 crash with MTP
UV_VERSION=0.13.8
LOCKS="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/deploy/sglang-locks"
LOCK="$LOCKS/sglang-$SGLANG_VERSION.lock"
if [ ! -f "$LOCK" ]; then
  have=$(cd "$LOCKS" 2>/dev/null && ls sglang-*.lock 2>/dev/null | sed 's/^sglang-//; s/\.lock$//' | paste -sd' ' \
         || true)
  echo "refusing: no lock for SGLang $SGLANG_VERSION in $LOCKS (locked: ${have:-none}); set SGLANG_VERSION to a" \
       "locked version, or lock this one first: scripts/lock-sglang-venv.sh $SGLANG_VERSION" \
       "(docs/sglang-versions.md)" >&2
  exit 2
fi
need=$(sed -n 's/^# glibc: //p' "$LOCK" | head -1)
python=$(sed -n 's/^# python: //p' "$LOCK" | head -1)
if ! [[ "$need" =~ ^[0-9]+\.[0-9]+$ ]] || [ -z "$python" ]; then
  echo "refusing: $LOCK names no glibc or python in its header;" \
       "rewrite it: scripts/lock-sglang-venv.sh $SGLANG_VERSION" >&2
  exit 2
fi
# The C library this venv will run on (in the image: the image's). SGLANG_VENV_GLIBC stands in for it (tests).
glibc_here() {  # "glibc 2.36" -> 2.36; nothing on another C library (musl)
  { getconf GNU_LIBC_VERSION 2>/dev/null \
    || python3 -c "import os; print(os.confstr('CS_GNU_LIBC_VERSION') or '')" 2>/dev/null; } | sed -n 's/^glibc //p'
}
found="${SGLANG_VENV_GLIBC-$(glibc_here || true)}"
older() {  # older A B: MAJOR.MINOR A is below B
  local a=${1#*.} b=${2#*.}
  (( ${1%%.*} < ${2%%.*} || (${1%%.*} == ${2%%.*} && ${a%%.*} < ${b%%.*}) ))
}
if ! [[ "$found" =~ ^[0-9]+\.[0-9]+ ]] || older "$found" "$need"; then
  echo "refusing: glibc ${found:-not found} here, SGLang $SGLANG_VERSION's lock needs glibc >= $need" \
       "($LOCK: its wheels, SGLang's own among them, are manylinux_${need/./_}); build on a newer OS" \
       "(Debian 12, Ubuntu 22.04, RHEL 9 or later) or in the image: docker compose run --rm sglang-venv" >&2
  exit 2
fi
fstype=$(stat -f -c %T "$(dirname "$VENV")")
case "$fstype" in
  nfs*|cifs|smb*|fuse*|9p|lustre|gpfs|ceph*|glusterfs)
    echo "refusing: $(dirname "$VENV") is on $fstype; pick a local disk (e.g. /opt or /dev/shm)" >&2; exit 2;;
esac
command -v nvidia-smi >/dev/null || echo "warning: nvidia-smi not found; SGLang needs CUDA GPUs to serve" >&2
if ! command -v uv >/dev/null 2>&1 || [ "$(uv --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
  python3 -m pip install --quiet "uv==$UV_VERSION"
fi
echo "SGLang $SGLANG_VERSION from $LOCK ($(sed -n 's/^# packages: //p' "$LOCK") packages; glibc $found >= $need)"
# Again after a lock refresh or another SGLANG_VERSION: the same venv, made exactly the new lock (sync removes
# the rest).
uv venv --allow-existing --python "$python" "$VENV"
# Exactly the lock: nothing resolved, wheels only, and the venv checked complete afterwards.
VIRTUAL_ENV="$VENV" uv pip sync --strict --only-binary :all: "$LOCK"
time "$VENV/bin/python" -c "import sglang, sglang.srt.server_args; print('sglang', sglang.__version__)"
echo "server_command: $VENV/bin/python -m sglang.launch_server"
