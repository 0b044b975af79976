"""Process identity of the fleet (fleet/servers.py): a server is its pid *and* its start time, read with psutil."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from dflash_regen.fleet.servers import Server, is_alive, start_ticks, stop_servers


def _server(proc: subprocess.Popen, ticks: int, pgid: int = 0) -> Server:
    return Server(0, "0", "127.0.0.1", 1, [], "/dev/null", pid=proc.pid, start_ticks=ticks, pgid=pgid)


def _sleeper(*extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *extra], start_new_session=True)


def test_the_start_time_is_the_one_proc_stat_records():
    """Records written before psutil (fleet/server-<i>.json, the run lock) keep identifying their process."""
    ticks = int(Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
    assert start_ticks(os.getpid()) == ticks
    assert start_ticks(0) == 0 and start_ticks(2**22 + 12345) == 0


def test_a_server_is_alive_while_its_pid_and_start_time_match_and_not_as_a_zombie():
    proc = _sleeper()
    try:
        ticks = start_ticks(proc.pid)
        assert is_alive(_server(proc, ticks))
        assert not is_alive(_server(proc, ticks + 1))  # the pid, reused by another process
        os.kill(proc.pid, signal.SIGKILL)
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped: a zombie
        assert not is_alive(_server(proc, ticks))
    finally:
        proc.kill()
        proc.wait()


def test_stop_ends_the_group_and_reaps_the_watcher_this_process_started():
    """The watcher stands for fleet/watch.py: the group leader, a child of the launcher, the server's parent."""
    watcher = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                                "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                                "print(p.pid, flush=True); p.wait()"],
                               stdout=subprocess.PIPE, start_new_session=True, text=True)
    try:
        assert watcher.stdout is not None
        pid = int(watcher.stdout.readline())
        server = Server(0, "0", "127.0.0.1", 1, [], "/dev/null", pid=pid, start_ticks=start_ticks(pid),
                        pgid=watcher.pid)
        assert stop_servers([server], grace_s=10) == [f"{server.name} pid {pid}"]
        assert not is_alive(server)
        # Reaped by the stop (psutil.wait_procs): the launcher can no longer wait for it.
        assert not Path(f"/proc/{watcher.pid}").exists()
    finally:
        watcher.kill()
        watcher.wait()
