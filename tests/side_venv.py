"""A judge's side venv under ~/.cache/dflash-regen/, built once and reused (CI keeps that cache): under a file
lock, in a temporary directory renamed into place, so parallel test workers neither race nor see half a venv.
Its name carries a hash of what it is built from: a changed pin builds a new one."""

from __future__ import annotations

import fcntl
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE = Path.home() / ".cache" / "dflash-regen"


def built_once(name: str, build: Callable[[Path], None], ready: str = "bin/python") -> Path:
    """CACHE/name, made first by `build(folder)` if it lacks `ready`."""
    root = CACHE / name
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{name.rsplit('-', 1)[0]}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / ready).is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=CACHE))
            try:
                build(tmp)
                tmp.rename(root)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return root
