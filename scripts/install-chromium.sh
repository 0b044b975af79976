#!/usr/bin/env bash
# The browser tests drive Debian's Chromium (Playwright never downloads a browser here). Install it if missing.
set -euo pipefail
[ -x /usr/bin/chromium ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if ! command -v apt-get >/dev/null || { [ -n "$SUDO" ] && ! sudo -n true 2>/dev/null; }; then
  echo "The browser tests need /usr/bin/chromium: install Debian's 'chromium' package (apt-get install chromium)" >&2
  exit 1
fi
echo "installing Debian's chromium for the browser tests (~1 min)"
$SUDO apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
