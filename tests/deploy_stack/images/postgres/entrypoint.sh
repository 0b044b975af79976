#!/bin/bash
# The official postgres image's entrypoint, as far as docker-compose.yaml uses it: a first start initialises
# PGDATA with POSTGRES_USER (default postgres) / POSTGRES_PASSWORD (required) and creates POSTGRES_DB (default:
# the user's name), password auth for every host; then postgres runs as the postgres user, on all addresses.
set -euo pipefail
if [ "$(id -u)" = 0 ]; then
  install -d -o postgres -g postgres -m 700 "$PGDATA"
  exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi
user="${POSTGRES_USER:-postgres}" db="${POSTGRES_DB:-${POSTGRES_USER:-postgres}}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  if [ -z "${POSTGRES_PASSWORD:-}" ]; then
    echo "Error: Database is uninitialized and superuser password is not specified. Set POSTGRES_PASSWORD." >&2
    exit 1
  fi
  pwfile=$(mktemp); printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
  # UTF8, as the official image (its LANG is en_US.utf8): psycopg 3 returns bytes from an SQL_ASCII database
  initdb --username="$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 \
    --locale=C.UTF-8 -D "$PGDATA" >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
  if [ "$db" != postgres ]; then
    pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -k /tmp" -w start >/dev/null
    psql -h /tmp -U "$user" -d postgres -v ON_ERROR_STOP=1 -q -c "CREATE DATABASE \"$db\"" >/dev/null
    pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
  fi
  echo "PostgreSQL init process complete; ready for start up."
fi
[ "$1" = postgres ] && exec postgres -c listen_addresses='*' -k /var/run/postgresql "${@:2}"
exec "$@"
