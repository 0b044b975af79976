#!/bin/sh
# SGLang's own Grafana dashboard, downloaded on the GPU node at deploy time by the monitoring profile's one-shot
# `grafana-dashboards` service (docker-compose.yaml) into the folder Grafana provisions it from. The file is
# SGLang's and is not kept in this repository. The URL names a commit of SGLang's repository and the file must
# have the pinned sha256, so Grafana serves exactly that commit's file; other bytes are never installed.
# Usage: SGLANG_DASHBOARD_URL=... SGLANG_DASHBOARD_SHA256=... download-sglang-dashboard.sh DEST_DIR
# POSIX sh with wget and sha256sum: Grafana's image (busybox) and Debian alike.
set -eu
dest_dir=${1:?usage: download-sglang-dashboard.sh DEST_DIR}
url=${SGLANG_DASHBOARD_URL:?set SGLANG_DASHBOARD_URL}
want=${SGLANG_DASHBOARD_SHA256:?set SGLANG_DASHBOARD_SHA256}
dest=$dest_dir/sglang-dashboard.json
part=$dest.part  # not *.json: Grafana never provisions a half-written file

sha256() { sha256sum "$1" | cut -d ' ' -f 1; }

if [ -f "$dest" ] && [ "$(sha256 "$dest")" = "$want" ]; then
  echo "SGLang's dashboard is in place: $dest (sha256 $want)"
  exit 0
fi
rm -f "$part"
if ! wget -q -O "$part" "$url"; then  # no -T: some busybox builds crash on it
  rm -f "$part"
  echo "error: could not download SGLang's dashboard from $url; Grafana runs without it." \
       "Retry with: docker compose --profile monitoring run --rm grafana-dashboards" >&2
  exit 1
fi
got=$(sha256 "$part")
if [ "$got" != "$want" ]; then
  rm -f "$part"
  echo "error: SGLang's dashboard from $url has sha256 $got, not the pinned $want: not installed" >&2
  exit 1
fi
chmod 644 "$part"
mv -f "$part" "$dest"
echo "SGLang's dashboard installed: $dest (sha256 $want)"
