#!/usr/bin/env bash
# The monitoring test (tests/integration/test_monitoring.py) scrapes the emulated fleet with Debian's prometheus
# (the test starts it on loopback in a temporary folder); tests/deploy/test_compose.py runs the monitoring profile's
# dashboard download (deploy/monitoring/download-sglang-dashboard.sh) with wget. Install them if missing.
set -euo pipefail
command -v prometheus >/dev/null && command -v wget >/dev/null && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if ! command -v apt-get >/dev/null || { [ -n "$SUDO" ] && ! sudo -n true 2>/dev/null; }; then
  echo "The monitoring tests need prometheus and wget: install Debian's packages (apt-get install prometheus wget)" >&2
  exit 1
fi
echo "installing Debian's prometheus and wget for the monitoring tests"
$SUDO apt-get update -qq >/dev/null
# --no-install-recommends: the server alone, without the node exporter and its friends
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus wget >/dev/null
