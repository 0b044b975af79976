"""The parent of one server process, so that how it ended is known after the task that launched it is gone.

    python -m dflash_regen.fleet.watch <exit record path> <server argv...>

A server outlives the `launch_fleet` task process, so nobody could `waitpid` it: a shard that finds its
server gone could only say "gone". This process starts the server in its own process group (the group
`stop_fleet` signals), prints the server's pid on stdout for the launcher, waits for it and writes
`{"pid", "returncode", "signal", "ended_at"}` to the exit record (tmp + rename). It ignores SIGTERM and SIGINT
so a stop records the server's own exit; a SIGKILL of the group ends both, as a stop that escalated
should. Standard library only: it starts in tens of milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    record, command = argv[0], argv[1:]
    # A handler, not SIG_IGN: an ignored signal would stay ignored in the server after exec.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=2, stderr=2)  # fd 2: the server log
    print(proc.pid, flush=True)
    sys.stdout.close()  # the launcher reads one line, then may exit
    code = proc.wait()
    ended = {"pid": proc.pid, "returncode": code, "signal": signal.Signals(-code).name if code < 0 else None,
             "ended_at": time.time()}
    tmp = f"{record}.tmp"
    with open(tmp, "w") as f:
        json.dump(ended, f)
    os.replace(tmp, record)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
