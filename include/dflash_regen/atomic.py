"""Atomic file writes: a temporary name in the same directory, then one rename.

A reader (or a resumed task) sees the old file or the whole new one, never a half-written one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _tmp(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(f".{path.name}.tmp")


def write_text(path: Path, text: str) -> None:
    tmp = _tmp(path)
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, data) -> None:
    write_text(path, json.dumps(data, indent=1, sort_keys=True, default=str))


def write_lines(path: Path, lines: list[str]) -> None:
    write_text(path, "".join(line + "\n" for line in lines))


def write_table(table, path: Path) -> None:
    """A pyarrow table as parquet."""
    import pyarrow.parquet as pq

    tmp = _tmp(path)
    pq.write_table(table, tmp)
    os.replace(tmp, path)
