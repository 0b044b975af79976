#!/usr/bin/env bash
# SGLang's venv locks: sglang-V.lock in deploy/sglang-locks/, every package of `sglang[all]==V` pinned for the GPU
# node (Linux x86_64, glibc >= GLIBC, Python PYTHON), from the index uv is configured with and wheels only.
# scripts/build-sglang-venv.sh installs one of them (uv pip sync) and reads its header (glibc, python).
#   scripts/lock-sglang-venv.sh [VERSION ...]          refresh (make sglang-locks): the packages on the index a
#                                                      day ago (EXCLUDE_NEWER=2026-12-01T00:00:00Z picks another
#                                                      cut-off; without it, a lock whose pins did not change is kept)
#   scripts/lock-sglang-venv.sh --check [VERSION ...]  resolve each lock again with its own header's inputs
#                                                      (cut-off included) and exit 1 if any pin differs
# No VERSION: every lock there. A new VERSION writes a new lock; commit it with the docs' list
# (docs/sglang-versions.md). The cut-off date is what makes a lock reproducible: the resolver given the same
# requirement, platform, Python and date gives the same pins however many releases came since. It defaults to a
# day ago, not now: a file uploaded minutes before "now" may not be listed by the index yet, and a lock cut at
# "now" then misses a version that every later check sees (cython 3.3.2, uploaded just before 0.5.23's first lock).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOCKS="${SGLANG_LOCKS_DIR:-$ROOT/deploy/sglang-locks}"  # SGLANG_LOCKS_DIR: the tests check a copy
GLIBC=2.34   # the node's floor: SGLang's own wheels (0.5.16 and 0.5.23) are manylinux_2_34 only
PYTHON=3.11  # the image's Python (deploy/Dockerfile), which the sglang-venv service builds the venv with
UV_VERSION=0.13.8

check=0
if [ "${1:-}" = "--check" ]; then check=1; shift; fi
versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
  for f in "$LOCKS"/sglang-*.lock; do
    [ -e "$f" ] || continue
    v="${f##*/sglang-}"; versions+=("${v%.lock}")
  done
fi
if [ ${#versions[@]} -eq 0 ]; then
  echo "no lock in $LOCKS: name the SGLang version(s) to lock, e.g. $0 0.5.16" >&2; exit 2
fi
if ! command -v uv >/dev/null 2>&1 || [ "$(uv --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
  python3 -m pip install --quiet "uv==$UV_VERSION"
fi

field() { sed -n "s/^# $1: //p" "$2" | head -1; }  # field NAME LOCK: a header line's value
pins() { grep -E '^[A-Za-z0-9]' "$1" | sort; }     # the NAME==VERSION lines

# lock VERSION GLIBC PYTHON EXCLUDE_NEWER OUT: the lock file, header and pins, written to OUT.
lock() {
  local version=$1 glibc=$2 python=$3 cutoff=$4 out=$5
  local platform="x86_64-manylinux_${glibc/./_}" body
  local args=(--python-version "$python" --python-platform "$platform" --exclude-newer "$cutoff"
              --only-binary :all: --no-emit-index-url --no-header)
  body=$(mktemp)
  local started=$SECONDS
  echo "sglang[all]==$version" | uv pip compile --quiet "${args[@]}" - -o "$body"
  echo "sglang $version: resolved in $((SECONDS - started)) s" >&2
  {
    echo "# SGLang $version's own venv on the GPU node, every package pinned; scripts/build-sglang-venv.sh installs it."
    echo "# Written by scripts/lock-sglang-venv.sh (make sglang-locks); checked by tests/deploy/test_sglang_locks.py."
    echo "# glibc: $glibc"
    echo "# python: $python"
    echo "# platform: $platform"
    echo "# exclude-newer: $cutoff"
    echo "# requirement: sglang[all]==$version"
    echo "# packages: $(grep -cE '^[A-Za-z0-9]' "$body")"
    echo "# resolver: uv $UV_VERSION pip compile ${args[*]}"
    cat "$body"
  } >"$out"
  rm -f "$body"
}

status=0
for version in "${versions[@]}"; do
  file="$LOCKS/sglang-$version.lock"
  if [ "$check" -eq 0 ]; then
    mkdir -p "$LOCKS"
    tmp="$(mktemp "$LOCKS/.sglang-$version.XXXXXX")"
    lock "$version" "$GLIBC" "$PYTHON" "${EXCLUDE_NEWER:-$(date -u -d "1 day ago" +%Y-%m-%dT%H:%M:%SZ)}" "$tmp"
    if [ -z "${EXCLUDE_NEWER:-}" ] && [ -f "$file" ] && [ "$(field glibc "$file")" = "$GLIBC" ] \
       && [ "$(field python "$file")" = "$PYTHON" ] && [ "$(pins "$file")" = "$(pins "$tmp")" ]; then
      rm -f "$tmp"; echo "kept $file: the same pins today"; continue  # no new date without a new pin
    fi
    chmod 644 "$tmp" && mv "$tmp" "$file"
    echo "wrote $file ($(field packages "$file") packages)"
    continue
  fi
  if [ ! -f "$file" ]; then
    echo "sglang $version: no lock $file (write it: $0 $version)" >&2; status=1; continue
  fi
  glibc=$(field glibc "$file") python=$(field python "$file") cutoff=$(field exclude-newer "$file")
  if [ -z "$glibc" ] || [ -z "$python" ] || [ -z "$cutoff" ]; then
    echo "sglang $version: $file lacks a glibc, python or exclude-newer header line (rewrite it: $0 $version)" >&2
    status=1; continue
  fi
  fresh=$(mktemp)
  lock "$version" "$glibc" "$python" "$cutoff" "$fresh"
  if ! cmp -s "$file" "$fresh"; then
    echo "sglang $version: $file is not what its inputs resolve to (< the lock, > the resolver now):" >&2
    diff <(pins "$file") <(pins "$fresh") | grep '^[<>]' >&2 || diff "$file" "$fresh" | head -20 >&2 || true
    echo "refresh it: $0 $version (or make sglang-locks), then commit it" >&2
    status=1
  else
    echo "sglang $version: $file is current ($(field packages "$file") packages, glibc >= $glibc)"
  fi
  rm -f "$fresh"
done
exit "$status"
