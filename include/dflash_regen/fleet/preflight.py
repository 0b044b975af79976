"""Everything checkable before a server process starts, so a launch that cannot work fails in seconds with the fix:
the model dir, one GPU per server, free ports, and a server interpreter on a local disk that imports its package in
time (SGLang's imports hang on a network filesystem); the SGLang version found picks the launch argv's dialect.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import socket
import subprocess
import time
from pathlib import Path

from dflash_regen.errors import FleetError, LaunchRefused
from dflash_regen.settings.run_config import FleetConfig
from dflash_regen.sglang.api import Dialect

log = logging.getLogger(__name__)

NETWORK_FILESYSTEMS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "lustre", "gpfs", "beegfs", "ceph",
                       "glusterfs", "afs", "davfs"}


def _mount_type(path: Path) -> tuple[str, str]:
    """Filesystem type and mount point holding `path` (longest matching mount point)."""
    best = ("", "")
    real = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            mount = parts[1].replace("\\040", " ")
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best[1]):
                best = (parts[2], mount)
    return best


def _is_network_fs(fstype: str) -> bool:
    return fstype in NETWORK_FILESYSTEMS or fstype.startswith("fuse.sshfs") or fstype.startswith("nfs")


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise LaunchRefused(f"port {port} on {host} is already in use ({exc.strerror}); another server is "
                             f"running there. Find it with `ss -ltnp 'sport = :{port}'` and stop it, or set Param "
                             "base_port to a free range.") from exc


def check_server_command(cfg: FleetConfig) -> str:
    """The interpreter must be on a local disk and import the server package in time; returns its version."""
    exe = shutil.which(cfg.server_argv[0])
    if exe is None:
        raise LaunchRefused(f"server command {cfg.server_argv[0]!r} not found or not executable; build SGLang's "
                         "venv with scripts/build-sglang-venv.sh and set Param server_command to its python")
    fstype, mount = _mount_type(Path(exe))
    if _is_network_fs(fstype):
        raise LaunchRefused(f"server interpreter {exe} is on a network filesystem ({fstype} at {mount}); SGLang's "
                         "imports hang there. Build a local venv (scripts/build-sglang-venv.sh) and point Param "
                         "server_command at it.")
    argv = list(cfg.server_argv)
    if "-m" not in argv[:-1]:
        return ""
    package = argv[argv.index("-m") + 1].split(".")[0]
    # The emulator says which SGLang it emulates (its profile is in the launch env); SGLang has __version__.
    code = ("from dflash_regen.emulator.versions import emulated_version; print(emulated_version())"
            if cfg.is_emulator else f"import {package}; print(getattr({package}, '__version__', ''))")
    probe = [argv[0], "-c", code]
    started = time.monotonic()
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=cfg.import_timeout_s, check=False,
                              env={**os.environ, **dict(cfg.env)})
    except subprocess.TimeoutExpired as exc:
        raise FleetError(f"`{shlex.join(probe)}` did not finish in {cfg.import_timeout_s:.0f} s: imports are "
                         "hanging (network filesystem? see the seed); use a local venv") from exc
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise LaunchRefused(f"`{shlex.join(probe)}` failed (exit {done.returncode}): {last}. Install the server "
                            "package into that interpreter (scripts/build-sglang-venv.sh).")
    version = (done.stdout.strip().splitlines() or [""])[-1]
    log.info("pre-flight: %s imports %s %s in %.1f s", argv[0], package, version, time.monotonic() - started)
    return version


def is_hybrid(model_path: Path) -> bool:
    """Mamba-hybrid (Qwen3.5/3.6, Qwen3-Next) by the checkpoint's architecture, as SGLang decides it."""
    try:
        archs = json.loads((model_path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return True
    return any(a.startswith(("Qwen3_5", "Qwen3Next")) for a in archs)


def preflight(cfg: FleetConfig, addresses: list[tuple[str, int]], model_path: Path) -> Dialect | None:
    """Everything checkable before a process starts (`addresses`: each server's host and port); returns the
    SGLang version's dialect (None if unknown)."""
    if not (model_path / "config.json").is_file():
        raise LaunchRefused(f"model dir {model_path} has no config.json; run stage_weights first")
    if len(set(cfg.gpu_ids)) != len(cfg.gpu_ids):
        raise LaunchRefused(f"GPU ids {','.join(cfg.gpu_ids)} repeat a GPU; give each server its own")
    for host, port in addresses:
        check_port_free(host, port)
    version = check_server_command(cfg)
    if not version:
        return None
    dialect = Dialect(version)
    dialect.refuse(dialect.launch_flags(list(cfg.flags)), hybrid=is_hybrid(model_path))
    return dialect
