#!/usr/bin/env bash
# The two-node test runs Airflow's CeleryExecutor on Debian's redis-server (the test starts it on loopback).
# Install it if missing.
set -euo pipefail
command -v redis-server >/dev/null && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if ! command -v apt-get >/dev/null || { [ -n "$SUDO" ] && ! sudo -n true 2>/dev/null; }; then
  echo "The two-node Celery test needs redis-server: install Debian's 'redis-server' package (apt-get install redis-server)" >&2
  exit 1
fi
echo "installing Debian's redis-server for the two-node Celery test"
$SUDO apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
