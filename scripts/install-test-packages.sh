#!/usr/bin/env bash
# The tests' programs from Debian's archive, each installed if missing (the tests start them on loopback):
# Chromium for the browser tests (Playwright never downloads a browser here), redis-server for the two-node
# Celery test, prometheus for tests/integration/test_monitoring.py, wget for the monitoring profile's
# dashboard download and docker-compose (Compose v1: its `config` reads docker-compose.yaml, no Docker engine) for
# tests/deploy/test_compose.py. One `apt-get update` for all.
set -euo pipefail
packages=() lean=()  # lean: --no-install-recommends (prometheus alone, without the node exporter and its friends)
[ -x /usr/bin/chromium ] || packages+=(chromium)
command -v redis-server >/dev/null || packages+=(redis-server)
command -v prometheus >/dev/null || lean+=(prometheus)
command -v wget >/dev/null || lean+=(wget)
command -v docker-compose >/dev/null || lean+=(docker-compose)
[ $((${#packages[@]} + ${#lean[@]})) -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if ! command -v apt-get >/dev/null || { [ -n "$SUDO" ] && ! sudo -n true 2>/dev/null; }; then
  echo "The tests need Debian's packages ${packages[*]} ${lean[*]}: install them (apt-get install ...)" >&2
  exit 1
fi
echo "installing Debian's ${packages[*]} ${lean[*]} for the tests (~1 min)"
$SUDO apt-get update -qq >/dev/null
export DEBIAN_FRONTEND=noninteractive
[ ${#packages[@]} -eq 0 ] || $SUDO apt-get install -y -qq "${packages[@]}" >/dev/null
[ ${#lean[@]} -eq 0 ] || $SUDO apt-get install -y -qq --no-install-recommends "${lean[@]}" >/dev/null
