#!/usr/bin/env bash
# Build SGLang's own venv on the GPU node, on a LOCAL disk (the seed's imports hung on a network mount).
# Usage: scripts/build-sglang-venv.sh [/opt/sglang-venv]   (env SGLANG_VERSION, default 0.5.16)
# Then set Param server_command (or env DFLASH_SERVER_COMMAND) to: <venv>/bin/python -m sglang.launch_server
set -euo pipefail
VENV="${1:-/opt/sglang-venv}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.16}"  # supported 0.5.10-0.5.23 (include/dflash_regen/sglang/api.py); Qwen3.6 cookbook ran 0.5.16; 0.5.13/0.5.14 crash with MTP
fstype=$(stat -f -c %T "$(dirname "$VENV")")
case "$fstype" in
  nfs*|cifs|smb*|fuse*|9p|lustre|gpfs|ceph*|glusterfs)
    echo "refusing: $(dirname "$VENV") is on $fstype; pick a local disk (e.g. /opt or /dev/shm)" >&2; exit 2;;
esac
command -v nvidia-smi >/dev/null || echo "warning: nvidia-smi not found; SGLang needs CUDA GPUs to serve" >&2
python3 -m pip install --quiet "uv==0.13.8"
uv venv --python 3.11 "$VENV"
VIRTUAL_ENV="$VENV" uv pip install "sglang[all]==$SGLANG_VERSION"
time "$VENV/bin/python" -c "import sglang, sglang.srt.server_args; print('sglang', sglang.__version__)"
echo "server_command: $VENV/bin/python -m sglang.launch_server"
