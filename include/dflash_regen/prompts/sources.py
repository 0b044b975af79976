"""Read a prompt source as a stream of raw rows, with flat memory, from the files people have.

A source is one file or a directory (read recursively: files in sorted path order, then save_to_disk folders)
of:
- `.jsonl` / `.jsonl.gz`: one JSON row per line (a UTF-8 BOM is allowed);
- `.json` / `.json.gz`: a JSON array of rows, streamed element by element, or JSON Lines (what
  `datasets.Dataset.to_json` writes);
- `.csv`: a header row, then one row per record (JSON columns such as `messages` as strings);
- `.parquet`: read in record batches;
- a Hugging Face dataset saved with `save_to_disk` (a folder with `state.json`, `dataset_info.json` and
  Arrow stream files): its Arrow files are read batch by batch with pyarrow, in the order
  `state.json` lists them. pyarrow is enough for this format, so the pipeline needs no `datasets` (and its
  dependency tree) at run time. A `DatasetDict` folder with one split is read; with several, the user
  picks one (regenerating a test split into training data would be a silent mistake).
Documentation files (hidden files, `README*`, `LICENSE*`, `*.md`) and cache files beside a save_to_disk
folder's data are skipped and named in the plan; any other file is an error naming it, so no rows are left
out without a word.
"""

from __future__ import annotations

import csv
import gzip
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from dflash_regen.errors import PromptSourceError

SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".csv", ".parquet")
HF_METADATA = ("state.json", "dataset_info.json")
_CHUNK = 1 << 16


def _is_doc(path: Path) -> bool:
    name = path.name
    return name.startswith(".") or name.upper().startswith(("README", "LICENSE")) or name.endswith(".md")


def _hf_dirs(source: Path) -> set[Path]:
    return {p.parent for p in source.rglob(HF_METADATA[0]) if (p.parent / HF_METADATA[1]).is_file()}


def _hf_data_files(folder: Path) -> list[Path]:
    state = json.loads((folder / "state.json").read_text())
    return [folder / f["filename"] for f in state.get("_data_files", [])]


def scan(source: Path) -> tuple[list[Path], list[Path]]:
    """(data files in reading order, files skipped: documentation and datasets' cache files)."""
    if source.is_file():
        if not source.name.endswith(SUFFIXES):
            raise PromptSourceError(f"prompt source {source} is not a file this reader reads; use "
                                    f"{', '.join(SUFFIXES)}, or a folder saved with datasets' save_to_disk")
        return [source], []
    if not source.is_dir():
        raise PromptSourceError(f"prompt source {source} does not exist; set Param prompt_source to a file "
                                f"({', '.join(SUFFIXES)}) or a directory of them")
    for listing in sorted(source.rglob("dataset_dict.json")):
        splits = json.loads(listing.read_text()).get("splits", [])
        if len(splits) > 1:
            raise PromptSourceError(f"prompt source {listing.parent} is a datasets DatasetDict with splits "
                                    f"{splits}; set Param prompt_source to the split to regenerate, e.g. "
                                    f"{listing.parent / splits[0]}")
    hf_dirs = _hf_dirs(source)
    hf_files = [f for d in sorted(hf_dirs) for f in _hf_data_files(d)]
    files, docs, unsupported = [], [], []
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        if path in hf_files or (path.parent in hf_dirs and path.name in HF_METADATA) \
                or path.name == "dataset_dict.json":
            continue
        if path.name.endswith(SUFFIXES):
            files.append(path)
        elif _is_doc(path) or (path.parent in hf_dirs and path.suffix == ".arrow"):  # docs, datasets' caches
            docs.append(path)
        else:
            unsupported.append(path)
    if unsupported:
        names = ", ".join(str(p.relative_to(source)) for p in unsupported[:5])
        more = f" and {len(unsupported) - 5} more" if len(unsupported) > 5 else ""
        raise PromptSourceError(f"prompt source {source} holds {len(unsupported)} file(s) this reader does not "
                                f"read: {names}{more}; their rows would be left out. Convert them to .jsonl or "
                                f".parquet, or move them out of the folder (read: {', '.join(SUFFIXES)} and "
                                "datasets saved with save_to_disk)")
    files += hf_files
    if not files:
        raise PromptSourceError(f"prompt source {source} has no readable files (need {', '.join(SUFFIXES)} or "
                                f"a datasets save_to_disk folder); found {[p.name for p in docs][:3] or 'nothing'}. "
                                "Put the prompt files there, or set Param prompt_source to the folder that holds them")
    return files, docs


def source_files(source: Path) -> list[Path]:
    return scan(source)[0]


def iter_raw(source: Path, batch_rows: int = 4096) -> Iterator[tuple[str, object]]:
    """(location, raw row) pairs: a text line for JSON Lines, a JSON array's element as decoded (any JSON value),
    a dict otherwise. Memory stays flat."""
    for path in source_files(source):
        name = str(path.relative_to(source)) if source.is_dir() else path.name
        if path.suffix == ".parquet":
            yield from _iter_parquet(path, name, batch_rows)
        elif path.suffix == ".arrow":
            yield from _iter_arrow(path, name)
        elif path.suffix == ".csv":
            yield from _iter_csv(path, name)
        else:
            opener = gzip.open if path.suffix == ".gz" else open
            # utf-8-sig drops a leading byte-order mark, which editors on Windows write.
            with opener(path, "rt", encoding="utf-8-sig", errors="replace") as f:
                head = f.read(_CHUNK)
                if name.endswith((".json", ".json.gz")) and head.lstrip().startswith("["):
                    yield from _iter_json_array(f, head, name)
                else:
                    yield from _iter_lines(f, head, name)


def _own_keys(value):
    """A columnar row with the keys it was written with. An Arrow struct column holds the union of its rows'
    keys, and a key a row lacks reads back as null (tool schemas would gain other tools' properties as nulls);
    a null and a missing key cannot be told apart there, so null-valued keys are dropped."""
    if isinstance(value, dict):
        return {k: _own_keys(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_own_keys(v) for v in value]
    return value


def _iter_parquet(path: Path, name: str, batch_rows: int) -> Iterator[tuple[str, dict]]:
    import pyarrow.parquet as pq

    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
        for record in batch.to_pylist():
            row += 1
            yield f"{name}#{row}", _own_keys(record)


def _iter_arrow(path: Path, name: str) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa

    row = 0
    # Read batch by batch (datasets writes Arrow stream files of ~1,000-row batches); a memory map would keep
    # every page read resident until the OS needs it back, and show as a growing RSS.
    with pa.OSFile(str(path)) as f:
        for batch in pa.ipc.open_stream(f):
            for record in batch.to_pylist():
                row += 1
                yield f"{name}#{row}", _own_keys(record)


def _iter_csv(path: Path, name: str) -> Iterator[tuple[str, dict]]:
    csv.field_size_limit(sys.maxsize)  # a long prompt is one field
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as f:
        reader = csv.DictReader(f)
        for record in reader:
            yield f"{name}:{reader.line_num}", {k: v for k, v in record.items() if k is not None}


def _iter_lines(f, head: str, name: str) -> Iterator[tuple[str, str]]:
    lineno, pending = 0, head
    while True:
        *lines, pending = pending.split("\n")
        for line in lines:  # a blank line too: it is quarantined as such, so every line is accounted for
            lineno += 1
            yield f"{name}:{lineno}", line
        more = f.read(_CHUNK)
        if not more:
            break
        pending += more
    if pending.strip():
        yield f"{name}:{lineno + 1}", pending


def _iter_json_array(f, buf: str, name: str) -> Iterator[tuple[str, object]]:
    """The elements of a JSON array, decoded one at a time from a growing window of the file."""
    decoder = json.JSONDecoder()
    pos, index = buf.index("[") + 1, 0
    while True:
        while pos < len(buf) and (buf[pos].isspace() or (buf[pos] == "," and index)):
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            if pos == len(buf):
                raise json.JSONDecodeError("the file ends before the array's closing ]", buf, pos)
            element, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as exc:
            more = f.read(max(_CHUNK, len(buf)))  # doubling: a long element costs O(n) re-reads, not O(n^2)
            if not more:
                raise PromptSourceError(f"{name}: element {index + 1} of the JSON array cannot be read "
                                        f"({exc.msg}); the rest of the file is unreadable. Fix the file, or "
                                        "write it as JSON Lines (one row per line) so a bad row is quarantined "
                                        "on its own") from exc
            buf, pos = buf[pos:] + more, 0
            continue
        index += 1
        yield f"{name}#{index}", element
        pos = end
        if pos > _CHUNK:  # drop what was read, now and then rather than per element
            buf, pos = buf[pos:], 0
