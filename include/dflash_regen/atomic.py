"""Atomic file writes: a temporary name in the same directory, then one rename.

A reader (or a resumed task) sees the old file or the whole new one, never a half-written one. A write that
meets a full disk removes its temporary file and raises `DiskFull`, whose first line names the path, the space
it needs and the space free.

Durable too: the temporary file is fsynced before the rename and the directory after it (as fleet/staging.py
fsyncs the weights it copies), so a power loss or a crashed node leaves the old file or the whole new one, never
a renamed file whose bytes had not reached the disk yet, and a rename that returned is not lost.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path

from dflash_regen.errors import DiskFull


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC or a quota, from the OS or from pyarrow (whose IO errors carry the errno only in their text)."""
    return isinstance(exc, OSError) and (exc.errno in (errno.ENOSPC, errno.EDQUOT) or
                                         "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc))


def disk_full(path: Path, needed: int | None = None) -> DiskFull:
    """The error for `path` (a file, or the folder being filled) needing about `needed` bytes (None: not known, a
    write outside this module met the full disk)."""
    folder = path if path.is_dir() else path.parent
    while not folder.exists() and folder != folder.parent:  # a folder the failed write was about to fill
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    needs = "" if needed is None else f"it needs about {needed / 1e6:,.2f} MB, "
    return DiskFull(f"no space left on the disk of {folder} writing {path.name}: {needs}{free / 1e6:,.2f} MB are "
                    "free. Free space there (or set Param output_root to a larger disk), then clear the task: it "
                    "resumes from what is on disk, nothing half-written was kept")


@contextmanager
def _whole_or_absent(path: Path, tmp: Path, needed: int):
    try:
        yield
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if is_disk_full(exc):
            raise disk_full(path, needed) from exc
        raise


def _tmp(path: Path) -> Path:
    """A temporary name of this writer's own: two writers of one path (a shard run twice at once: a zombie task
    and its retry) never rename each other's file away. A dot name: no reader's glob takes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def _fsync(path: Path) -> None:
    """A file's bytes, or a directory's entries, on the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename(tmp: Path, path: Path) -> None:
    """`tmp` (fsynced) becomes `path`, and the rename itself is on the disk."""
    os.replace(tmp, path)
    _fsync(path.parent)


def write_text(path: Path, text: str) -> None:
    tmp = _tmp(path)
    data = text.encode()
    with _whole_or_absent(path, tmp, len(data)):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    _rename(tmp, path)


def write_json(path: Path, data) -> None:
    write_text(path, json.dumps(data, indent=1, sort_keys=True, default=str))


def write_lines(path: Path, lines: list[str]) -> None:
    write_text(path, "".join(line + "\n" for line in lines))


def write_table(table, path: Path) -> None:
    """A pyarrow table as parquet."""
    import pyarrow.parquet as pq

    tmp = _tmp(path)
    with _whole_or_absent(path, tmp, table.nbytes):  # its size in memory: about what parquet needs, at most
        pq.write_table(table, tmp)
        _fsync(tmp)
    _rename(tmp, path)


def link(src: Path, dst: Path) -> None:
    """`dst` becomes a hard link to `src` in one rename (the output root is one filesystem: docs/operations.md)."""
    tmp = _tmp(dst)
    os.link(src, tmp)
    _rename(tmp, dst)  # the bytes are src's own: only the new name needs syncing
