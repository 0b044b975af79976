"""Atomic writes are durable: the temporary file reaches the disk before the rename, the directory's new entry
after it (include/dflash_regen/atomic.py)."""

import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pytest

from dflash_regen import atomic


@pytest.fixture
def disk_calls(monkeypatch):
    """Every fsync (by the path its descriptor names) and rename, in order."""
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        calls.append(("rename", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return calls


@pytest.mark.parametrize("write", [
    lambda path: atomic.write_json(path, {"v": 1}),
    lambda path: atomic.write_table(pa.table({"v": [1, 2]}), path),
], ids=["json", "parquet"])
def test_a_write_syncs_the_file_before_the_rename_and_the_directory_after(tmp_path, disk_calls, write):
    path = tmp_path / "reports" / "out"
    write(path)
    tmp = disk_calls[0][1]  # the writer's own temporary name, beside the file
    assert re.fullmatch(rf"{re.escape(str(path.parent))}/\.out\.\d+-[0-9a-f]{{8}}\.tmp", tmp), tmp
    assert disk_calls == [("fsync", tmp), ("rename", tmp, str(path)), ("fsync", str(path.parent))]
    assert path.stat().st_size and not Path(tmp).exists()


def test_a_link_syncs_the_directory_after_its_rename(tmp_path, disk_calls):
    src = tmp_path / "src.parquet"
    src.write_bytes(b"rows")
    atomic.link(src, tmp_path / "store" / "dst.parquet")
    tmp, dst = disk_calls[0][1], tmp_path / "store" / "dst.parquet"
    assert re.fullmatch(rf"{re.escape(str(dst.parent))}/\.dst\.parquet\.\d+-[0-9a-f]{{8}}\.tmp", tmp), tmp
    assert disk_calls == [("rename", str(tmp), str(dst)), ("fsync", str(tmp_path / "store"))]
    assert os.path.samefile(src, dst)


def test_writers_racing_on_one_path_each_finish_and_leave_one_whole_file(tmp_path):
    """Airflow can run one shard twice at once (a zombie task and its retry): both write its status file. Each
    writer has its own temporary file, so neither renames the other's away."""
    import threading

    path, errors = tmp_path / "status" / "shard-00000.json", []

    def writer(n: int) -> None:
        try:
            for i in range(100):
                atomic.write_json(path, {"writer": n, "i": i})
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert json.loads(path.read_text())["i"] == 99 and not list(path.parent.glob(".*.tmp"))
