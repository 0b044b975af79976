"""Each shard's own status file, `status/shard-XXXXX.json`: what its task is doing now and every attempt so far.

`generate` writes it atomically when an attempt starts, at every checkpoint and when the attempt ends. The
Fleet page reads it for live progress (results a running shard holds in memory count too), the shard table
and the incidents (a failed attempt, its server and first error line; the retry and where it ran). A task
killed outright cannot write its end: its last attempt stays "running" with a stale `updated_at`, and the
reader decides what that means (ui/progress.py compares it with the next attempt and with Airflow's state).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dflash_regen import atomic


def read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class ShardStatus:
    """One attempt of one shard; each call rewrites the whole file (a few hundred bytes)."""

    def __init__(self, path: Path, shard: int, total: int, server: str, done_before: int, quarantined_before: int):
        self.path = path
        previous = read(path) or {}
        now = time.time()
        self.data = {"shard": shard, "total": total, "server": server, "state": "running",
                     "done": done_before, "quarantined": quarantined_before, "output_tokens": 0,
                     "attempts": previous.get("attempts", [])}
        self.attempt = {"server": server, "pid": os.getpid(), "started_at": now, "updated_at": now,
                        "state": "running", "done_before": done_before, "done": done_before, "output_tokens": 0}
        self.data["attempts"].append(self.attempt)
        self._write()

    def update(self, done: int, quarantined: int, output_tokens: int) -> None:
        self.data.update(done=done, quarantined=quarantined, output_tokens=output_tokens)
        self.attempt.update(done=done, output_tokens=output_tokens, updated_at=time.time())
        self._write()

    def finish(self, state: str, error: BaseException | None = None) -> None:
        """`state` is "done", "failed" or "drained"; a failure or a drain keeps the first line of its error."""
        now = time.time()
        self.data["state"] = state
        self.attempt.update(state=state, updated_at=now, ended_at=now)
        if error is not None:
            self.attempt["error"] = (str(error).strip().splitlines() or [type(error).__name__])[0]
        self._write()

    def _write(self) -> None:
        atomic.write_json(self.path, self.data)
