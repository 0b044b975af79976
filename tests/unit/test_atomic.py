"""Atomic writes are durable: the temporary file reaches the disk before the rename, the directory's new entry
after it (include/dflash_regen/atomic.py)."""

import os
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
    tmp = str(path.with_name(".out.tmp"))
    assert disk_calls == [("fsync", tmp), ("rename", tmp, str(path)), ("fsync", str(path.parent))]
    assert path.stat().st_size and not Path(tmp).exists()


def test_a_link_syncs_the_directory_after_its_rename(tmp_path, disk_calls):
    src = tmp_path / "src.parquet"
    src.write_bytes(b"rows")
    atomic.link(src, tmp_path / "store" / "dst.parquet")
    tmp, dst = tmp_path / "store" / ".dst.parquet.tmp", tmp_path / "store" / "dst.parquet"
    assert disk_calls == [("rename", str(tmp), str(dst)), ("fsync", str(tmp_path / "store"))]
    assert os.path.samefile(src, dst)
