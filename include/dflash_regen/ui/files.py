"""The run folder's files as the pages read them: JSON reports, and parquet reads cached per file (path, mtime,
size), so a refresh reads only the checkpoint parts written since the last one."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from dflash_regen.generate import status as shard_status
from dflash_regen.layout import RunLayout


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # not written yet, or being replaced right now


_CACHE: dict[tuple[str, str], tuple[tuple[int, int], object]] = {}


def cached(path: Path, kind: str, load):
    """`load(path)`, remembered until the file changes; None for a file that vanished or is half written."""
    try:
        st = path.stat()
    except OSError:
        return None
    key, stamp = (kind, str(path)), (st.st_mtime_ns, st.st_size)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    try:
        value = load(path)
    except (OSError, KeyError, ValueError):
        return None  # a part being written, or an older file without the column
    _CACHE[key] = (stamp, value)
    return value


def forget_missing(folder: Path) -> None:
    """Drop cache entries of merged-away checkpoint parts under `folder`, so the cache does not grow forever."""
    prefix = str(folder) + "/"
    for key in [k for k in _CACHE if k[1].startswith(prefix)]:
        if not Path(key[1]).exists():
            del _CACHE[key]


def row_count(path: Path) -> int:
    return cached(path, "rows", lambda p: pq.read_metadata(p).num_rows) or 0  # the footer only


def _columns(paths: list[Path], *names: str) -> list[list]:
    """The named columns over all files, read together so they stay row-aligned."""
    values: list[list] = [[] for _ in names]
    for path in paths:
        table = cached(path, "cols:" + ",".join(names), lambda p: pq.read_table(p, columns=list(names)))
        if table is None:
            continue
        for out, name in zip(values, names, strict=True):
            out.extend(table.column(name).to_pylist())
    return values


def read_column(paths: list[Path], column: str) -> list:
    return _columns(paths, column)[0]


def shard_statuses(run: Path) -> dict[int, dict]:
    out = {}
    for path in RunLayout(run).status_files():
        status = cached(path, "status", shard_status.read)  # a finished shard's file never changes again
        if status is not None:
            out[int(status["shard"])] = status
    return out


def node_assignment(run: Path) -> dict:
    """Several nodes: {node: {"shards": [...], ...}} from reports/assignment.json; {} for a one-node run."""
    return (read_json(RunLayout(run).report("assignment")) or {}).get("nodes", {})
