"""Launch, wait for, and stop the fleet of SGLang servers (one process per GPU).

Real SGLang and the emulator are started by the same code: an explicit argv (never a shell string),
`CUDA_VISIBLE_DEVICES=<gpu>`, port `base + i` on 127.0.0.1, an API key, stdout/stderr to
`fleet/server-<i>.log`, and the pid plus launch spec in `fleet/server-<i>.json`. Each server runs under a
small watcher (fleet/watch.py, its parent and process-group leader) in a session of its own, so it outlives
the task that started it and how it ended (exit code or signal) lands in `fleet/exit-<i>.json`;
`stop_fleet` ends exactly the recorded processes (by pid *and* start time, so a recycled pid is never killed).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from dflash_regen.errors import FleetError, GateFailed, LaunchRefused, NoServerFree
from dflash_regen.fleet.preflight import preflight
from dflash_regen.layout import FleetFiles
from dflash_regen.payloads import Fleet
from dflash_regen.settings.run_config import FleetConfig
from dflash_regen.sglang.api import Api, Dialect

log = logging.getLogger(__name__)

API_KEY_ENV = "DFLASH_SGLANG_API_KEY"
REDACTED = "***"


@dataclass(frozen=True)
class Server:
    """One launched (or to-be-launched) server, as recorded in `fleet/server-<i>.json`."""

    index: int
    gpu: str
    host: str
    port: int
    argv: list[str]
    log_path: str
    pid: int = 0  # the server process
    start_ticks: int = 0
    pgid: int = 0  # its process group: the watcher that waits on it (0 = the server itself)
    log_offset: int = 0  # where this launch's lines start in the log (a relaunch of the run appends to it)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def name(self) -> str:
        return f"server {self.index} (GPU {self.gpu}, {self.host}:{self.port})"


def how_it_ended(fleet_dir: Path, server: Server, wait_s: float = 0.0) -> str:
    """'was killed by SIGKILL', 'exited with code 1', or '' while the process runs. A caller that just lost
    its connections waits up to `wait_s`: a dying process still looks alive until the kernel has closed
    its sockets, and the watcher writes the record only after that."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            record = json.loads(FleetFiles(fleet_dir).exit_record(server.index).read_text())
        except (FileNotFoundError, ValueError):
            record = None
        if record and record.get("pid") == server.pid:
            if record["signal"]:
                return f"was killed by {record['signal']}"
            return f"exited with code {record['returncode']}"
        alive = is_alive(server)
        if time.monotonic() >= deadline:
            return "" if alive else "is gone (no exit status recorded: its watcher was killed too)"
        time.sleep(0.05)


def ensure_api_key(fleet_dir: Path) -> str:
    """The key from the environment (a deployment secret) or a fresh random one, kept 0600 in the fleet dir."""
    key = os.environ.get(API_KEY_ENV) or secrets.token_hex(24)
    fleet_dir.mkdir(parents=True, exist_ok=True)
    path = FleetFiles(fleet_dir).api_key
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    os.replace(tmp, path)
    return key


def read_api_key(fleet_dir: Path) -> str:
    path = FleetFiles(fleet_dir).api_key
    if not path.is_file():
        raise FleetError(f"no API key in {path}: the fleet of this run was never launched; run launch_fleet")
    return path.read_text().strip()


def redact(text: str, secret: str) -> str:
    return text.replace(secret, REDACTED) if secret else text


def log_tail(path: str | Path, secret: str = "", lines: int = 25) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return "(no log file)"
    tail = "\n".join(text.splitlines()[-lines:])
    return redact(tail, secret) or "(log is empty)"


def plan_servers(cfg: FleetConfig, model_path: Path, fleet_dir: Path, api_key: str,
                 dialect: Dialect | None = None) -> list[Server]:
    """One argv per server, with the flags in the names of the SGLang version that will run them."""
    flags = dialect.launch_flags(list(cfg.flags)) if dialect else list(cfg.flags)
    servers, files = [], FleetFiles(fleet_dir)
    for i in range(cfg.num_servers):
        argv = [*cfg.server_argv, "--model-path", str(model_path), "--served-model-name", cfg.served_model_name,
                # '=' form: a key that starts with '-' would otherwise read as a flag to argparse.
                "--host", cfg.host, "--port", str(cfg.port(i)), f"--api-key={api_key}", *flags]
        servers.append(Server(i, cfg.gpu_ids[i], cfg.host, cfg.port(i), argv, str(files.server_log(i))))
    return servers


# ------------------------------------------------------------------------------------------ process control
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def start_ticks(pid: int) -> int:
    """Process start time in clock ticks since boot (what /proc/<pid>/stat records, and the records in
    `fleet/server-<i>.json` and the run lock keep); 0 if gone."""
    try:
        return _ticks(psutil.Process(pid)) if pid > 0 else 0
    except psutil.Error:
        return 0


def _ticks(proc: psutil.Process) -> int:
    """psutil's `create_time` is the start since boot plus the boot time: the start since boot is kept, which a
    change of the system clock does not move."""
    return round((proc.create_time() - psutil.boot_time()) * CLOCK_TICKS)


def _process_of(server: Server) -> psutil.Process | None:
    """The recorded process while it is still the one launched (same pid, same start time) and not a zombie."""
    if server.pid <= 0:
        return None
    try:
        proc = psutil.Process(server.pid)
        return proc if _ticks(proc) == server.start_ticks and _running(proc) else None
    except psutil.Error:
        return None


def _running(proc: psutil.Process) -> bool:
    """Not ended: a zombie has (its parent has yet to reap it), and so has a pid now reused (psutil checks)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_alive(server: Server) -> bool:
    """True while the recorded process (same pid, same start time) exists and is not a zombie."""
    return _process_of(server) is not None


def _child_watcher(server: Server) -> psutil.Process | None:
    """The server's watcher (its process group leader) if this process started it: ours to reap."""
    if not server.pgid or server.pgid == server.pid:
        return None
    try:
        watcher = psutil.Process(server.pgid)
        return watcher if watcher.ppid() == os.getpid() else None
    except psutil.Error:
        return None


def start_server(server: Server, base_env: dict[str, str], fleet_dir: Path,
                 api_key: str) -> tuple[Server, subprocess.Popen]:
    """Start the server under its watcher; returns its record and the watcher process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}  # keep Airflow secrets out
    env.update(base_env)
    env["CUDA_VISIBLE_DEVICES"] = server.gpu
    env["PYTHONUNBUFFERED"] = "1"
    log.info("launching %s: %s", server.name, redact(shlex.join(server.argv), api_key))
    exit_record = FleetFiles(fleet_dir).exit_record(server.index)
    watch = [sys.executable, "-m", "dflash_regen.fleet.watch", str(exit_record)]
    with open(server.log_path, "ab") as logf:
        offset = logf.tell()
        proc = subprocess.Popen([*watch, *server.argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=logf, env=env, start_new_session=True, close_fds=True)
    assert proc.stdout is not None  # stdout=PIPE
    line = proc.stdout.readline()
    proc.stdout.close()
    if not line.strip().isdigit():
        proc.wait(timeout=30)
        raise FleetError(f"{server.name} could not be started (watcher exit {proc.returncode}); log: "
                         f"{server.log_path}; last lines:\n{log_tail(server.log_path, api_key)}")
    pid = int(line)
    launched = Server(**{**asdict(server), "pid": pid, "start_ticks": start_ticks(pid), "pgid": proc.pid,
                         "log_offset": offset})
    record = {**asdict(launched), "argv": [redact(a, api_key) for a in launched.argv],
              "env": base_env, "launched_at": time.time()}
    path = FleetFiles(fleet_dir).server_spec(server.index)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)
    return launched, proc


def load_servers(fleet_dir: Path) -> list[Server]:
    servers = []
    for path in FleetFiles(fleet_dir).server_specs():
        record = json.loads(path.read_text())
        servers.append(Server(**{k: record[k] for k in Server.__dataclass_fields__ if k in record}))
    return servers


def stop_servers(servers: list[Server], *, grace_s: float = 15.0) -> list[str]:
    """TERM each recorded process group, then KILL what is left; returns what was stopped."""
    live = [(s, proc) for s in servers if (proc := _process_of(s)) is not None]
    for server, _ in live:
        try:
            os.killpg(server.pgid or server.pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
    for server, _ in (left := _wait_ended(live, grace_s)):
        log.warning("%s ignored SIGTERM for %.0f s: sending SIGKILL", server.name, grace_s)
        try:
            os.killpg(server.pgid or server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for server, _ in _wait_ended(left, 5.0):
        raise FleetError(f"{server.name} pid {server.pid} is still alive after SIGKILL; check `ps -p "
                         f"{server.pid}` (stuck in the kernel? a GPU driver hang?)")
    return [f"{server.name} pid {server.pid}" for server, _ in live]


def _wait_ended(live: list[tuple[Server, psutil.Process]], timeout_s: float) -> list[tuple[Server, psutil.Process]]:
    """Wait up to `timeout_s` for the servers' processes to end (and for their watchers this process started, which
    `psutil.wait_procs` reaps); returns the servers still running."""
    watchers = [w for server, _ in live if (w := _child_watcher(server)) is not None]
    waiting = [proc for _, proc in live] + watchers
    deadline = time.monotonic() + timeout_s
    while True:
        running = [(server, proc) for server, proc in live if _running(proc)]
        left_s = deadline - time.monotonic()
        if left_s <= 0 or not (running or any(w in waiting for w in watchers)):
            return running
        _, waiting = psutil.wait_procs(waiting, timeout=min(left_s, 0.5))


def stop_fleet(fleet_dir: Path) -> list[str]:
    """Stop every server this run recorded. Safe to call twice, or when nothing was launched."""
    if not fleet_dir.is_dir():
        return []
    stopped = stop_servers(load_servers(fleet_dir))
    for line in stopped:
        log.info("stopped %s", line)
    return stopped


def mark_unhealthy(fleet_dir: Path, server: Server, reason: str) -> None:
    files = FleetFiles(fleet_dir)
    files.unhealthy(server.index).write_text(reason)
    with open(files.unhealthy_log, "a") as history:  # one short line per write: appends do not interleave
        history.write(json.dumps({"server": server.index, "gpu": server.gpu, "name": server.name,
                                  "reason": _first_line(reason), "at": time.time()}) + "\n")
    log.warning("marked %s unhealthy: %s", server.name, reason)


def unhealthy_history(fleet_dir: Path) -> list[dict]:
    """Every marking of `mark_unhealthy` in this fleet dir, oldest first, relaunches included."""
    try:
        lines = FleetFiles(fleet_dir).unhealthy_log.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a crash mid-write
    return out


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0]


def healthy_servers(fleet_dir: Path, servers: list[Server]) -> list[Server]:
    return [s for s in servers if is_alive(s) and not FleetFiles(fleet_dir).unhealthy(s.index).exists()]


# ------------------------------------------------------------------------------------------------- leases
@contextmanager
def lease(fleet_dir: Path, servers: list[Server], shard: int, wait_s: float,
          avoid: dict[int, str] | None = None) -> Iterator[Server]:
    """Hold one healthy server exclusively for the block (`with servers.lease(...) as server:`).

    The hold is an `flock` on `fleet/lease-<i>.lock`: it dies with the process, so a killed task never leaves a
    server leased. Never a server in `avoid` (where this shard failed before) while another is healthy; waits up
    to `wait_s` for one to come free, then raises `NoServerFree`.
    """
    server, fd = _take_lease(fleet_dir, servers, shard, wait_s, avoid)
    try:
        yield server
    finally:
        os.close(fd)


def _take_lease(fleet_dir: Path, servers: list[Server], shard: int, wait_s: float,
                avoid: dict[int, str] | None = None) -> tuple[Server, int]:
    deadline = time.monotonic() + wait_s
    avoid = avoid or {}
    while True:
        candidates = healthy_servers(fleet_dir, servers)
        if not candidates:
            raise NoServerFree(f"no healthy server left in {fleet_dir} ({len(servers)} launched); check the "
                               "server logs there, then clear launch_fleet to relaunch the fleet")
        if any(s.index not in avoid for s in candidates):  # waiting for another server beats a faulty GPU
            candidates = [s for s in candidates if s.index not in avoid]
        # Start at a shard-dependent server so parallel tasks spread out instead of racing for server 0.
        ordered = sorted(candidates, key=lambda s: (s.index - shard) % len(servers))
        for server in ordered:
            fd = os.open(FleetFiles(fleet_dir).lease_lock(server.index), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"shard {shard} pid {os.getpid()}\n".encode())
            for index, reason in sorted(avoid.items()):
                verdict = "leased it again: no other server is healthy" if index == server.index else \
                    f"leased {server.name} instead"
                log.warning("shard %d failed on server %d before (%s); %s", shard, index, reason, verdict)
            return server, fd
        if time.monotonic() > deadline:
            raise NoServerFree(f"all {len(candidates)} healthy servers stayed leased for {wait_s:.0f} s")
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------- readiness
def _health_ok(server: Server, timeout: float) -> bool:
    return Api(server.url, "").is_ready(timeout)


def wait_ready(servers: list[Server], procs: dict[int, subprocess.Popen], api_key: str, timeout_s: float,
               fleet_dir: Path) -> dict:
    """Poll /health on every server while watching its process; returns seconds-to-ready per index."""
    started = time.monotonic()
    pending = {s.index: s for s in servers}
    ready: dict[int, float] = {}
    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        while pending:
            for index, server in list(pending.items()):
                if procs[index].poll() is not None:  # the watcher ends when its server has ended
                    ended, tail = how_it_ended(fleet_dir, server), log_tail(server.log_path, api_key)
                    # Exit 2 is argparse refusing a flag; a ValueError is ServerArgs refusing a combination:
                    # the same argv fails the same way again, so a retry would only repeat it.
                    refused = ended == "exited with code 2" or "ValueError" in tail
                    hint = (" (it refused its flags: fix Param server_flags, or server_command for another SGLang "
                            "version)") if refused else ""
                    raise (LaunchRefused if refused else FleetError)(
                        f"{server.name} {ended} after {time.monotonic() - started:.0f} s, before it was ready{hint}; "
                        f"log: {server.log_path}; last lines:\n{tail}")
            results = dict(zip(pending, pool.map(lambda s: _health_ok(s, 5.0), pending.values()), strict=True))
            for index, ok in results.items():
                if ok:
                    ready[index] = time.monotonic() - started
                    log.info("%s ready after %.1f s", pending.pop(index).name, ready[index])
            if pending and time.monotonic() - started > timeout_s:
                lines = [f"{s.name} not ready after {timeout_s:.0f} s; log: {s.log_path}; last lines:\n"
                         f"{log_tail(s.log_path, api_key, 10)}" for s in pending.values()]
                raise FleetError("\n".join(lines) + "\nRaise Param ready_timeout_s if loading is just slow.")
            if pending:
                time.sleep(0.25)
    return ready


def confirm_version(servers: list[Server], api_key: str, expected: str) -> None:
    """After launch, /server_info must report the version pre-flight found (else the argv was built for
    another SGLang than the one running)."""
    for server in servers:
        running = Api(server.url, api_key).version()
        if running and running != expected:
            raise FleetError(f"{server.name} runs SGLang {running}, but its interpreter imported {expected} at "
                             "pre-flight; the argv was built for the wrong version. Check Param server_command.")
    log.info("fleet runs SGLang %s", expected)


def launch_fleet(cfg: FleetConfig, model_path: Path, fleet_dir: Path) -> list[Server]:
    """Stop leftovers of this run, pre-flight, start all servers, wait until every one is ready.

    On any failure every server this call started is stopped before the error propagates, so a failed
    launch never leaves processes behind (Airflow skips the teardown when its setup failed).
    """
    fleet_dir.mkdir(parents=True, exist_ok=True)
    leftovers = stop_fleet(fleet_dir)  # a re-run of this run's setup after a crash or a cleared shard
    if leftovers:
        log.warning("stopped %d servers left running by an earlier attempt of this run", len(leftovers))
    for marker in FleetFiles(fleet_dir).launch_markers():  # a fresh fleet
        marker.unlink()
    api_key = ensure_api_key(fleet_dir)
    dialect = preflight(cfg, [(s.host, s.port) for s in plan_servers(cfg, model_path, fleet_dir, api_key)], model_path)
    planned = plan_servers(cfg, model_path, fleet_dir, api_key, dialect)
    env = dialect.launch_env(dict(cfg.env)) if dialect else dict(cfg.env)
    launched: list[Server] = []
    procs: dict[int, subprocess.Popen] = {}
    try:
        for server in planned:
            record, procs[server.index] = start_server(server, env, fleet_dir, api_key)
            launched.append(record)
        ready = wait_ready(launched, procs, api_key, cfg.ready_timeout_s, fleet_dir)
        if dialect:
            confirm_version(launched, api_key, dialect.version)
    except BaseException:
        stop_servers(launched)
        raise
    log.info("fleet of %d servers ready in %.1f s (slowest)", len(launched), max(ready.values()))
    return launched


@contextmanager
def running(cfg: FleetConfig, model_path: Path, fleet_dir: Path) -> Iterator[list[Server]]:
    """A fleet for the block (`with running(...) as servers:`): launched, ready, and stopped on leaving it
    however the block ends (the CLIs' and autotune's own fleets; the DAG's outlives its task, see `launch_fleet`)."""
    servers = launch_fleet(cfg, model_path, fleet_dir)
    try:
        yield servers
    finally:
        stop_fleet(fleet_dir)


def fleet_value(fleet_dir: Path, servers: list[Server]) -> Fleet:
    """What the fleet's tasks hand on (XCom): its folder and each server's address, GPU, pid and log."""
    return {"fleet_dir": str(fleet_dir), "servers": [{"index": s.index, "url": s.url, "gpu": s.gpu, "pid": s.pid,
                                                      "log": s.log_path} for s in servers]}


def servers_of(fleet: Fleet, expected: int) -> tuple[list[Server], str]:
    """The servers of a fleet value (`fleet_value`) as its folder records them (pid and start time, for process
    control), and its API key."""
    fleet_dir = Path(fleet["fleet_dir"])
    servers = load_servers(fleet_dir)
    if len(servers) != expected:
        raise GateFailed(f"{fleet_dir} records {len(servers)} servers, expected {expected}; re-run launch_fleet")
    return servers, read_api_key(fleet_dir)
