"""A shard's checkpoints: finished rows in parts (tmp + rename), merged once into one file holding each sample once.
What is done is the merged file plus every part (`layout.shard_sources`, the checkpoint rule).
"""

from __future__ import annotations

import fcntl
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_regen import atomic
from dflash_regen.layout import new_part, shard_sources

# Merges of one shard are one per attempt: a read that loses this many races to them is not racing a merge.
MERGE_RACES = 5


def read_done(folder: Path, target: Path) -> set[str]:
    """Sample ids of one shard already on disk, merged or in parts.

    Another attempt of the shard (a zombie task, or a process that finishes while a poller reads) may merge the
    parts while they are read: a part gone missing is then in the merged file, so the files are listed again."""
    for _ in range(MERGE_RACES):
        try:
            done: set[str] = set()
            for path in shard_sources(target, folder):
                done.update(pq.read_table(path, columns=["sample_id"]).column("sample_id").to_pylist())
            return done
        except FileNotFoundError:
            continue
    raise RuntimeError(f"the checkpoints of {folder} kept changing while they were read ({MERGE_RACES} tries): "
                       "is a second attempt of this shard merging in a loop? Stop it and retry")



def write_part(folder: Path, rows: list[dict], schema: pa.Schema) -> None:
    if rows:
        table = pa.Table.from_pylist(rows, schema=schema)
        atomic.write_table(table, new_part(folder, time.time_ns(), uuid.uuid4().hex[:8]))


def merge_parts(folder: Path, target: Path, schema: pa.Schema) -> int:
    """One file, each sample once (first write wins), written atomically; parts removed afterwards.

    Duplicates are real: two attempts of one shard can run at once (a zombie task and its retry), and a
    kill between the rename and the unlinks leaves the merged rows in their parts too.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(f".{target.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent attempts merge one at a time (the lock dies with them)
        sources = shard_sources(target, folder)
        tables = [pq.read_table(p, schema=schema) for p in sources]
        table = pa.concat_tables(tables) if tables else schema.empty_table()
        ids = table.column("sample_id").to_pylist()
        seen: set = set()
        keep = []
        for i, sid in enumerate(ids):
            if sid not in seen:
                seen.add(sid)
                keep.append(i)
        table = table.take(pa.array(keep, pa.int64())) if len(keep) != len(ids) else table
        atomic.write_table(table, target)
        for p in sources:
            if p != target:
                p.unlink()
    return table.num_rows
