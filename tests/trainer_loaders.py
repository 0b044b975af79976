"""How trainers load a published `conversations.jsonl`, written out so tests can check nothing is lost.

SpecForge's offline path (`scripts/prepare_hidden_states.py`) runs its `safe_conversations_generator`
(each row's `conversations` turns with list/dict values as JSON strings, `tools` as a JSON string) through
`datasets.Dataset.from_generator`, whose Arrow writer takes the columns and types from the records it has
seen first. With `writer_batch_size=1` the first record alone decides them: a key it lacks is dropped from
every later row, and a later row missing a key, or holding a value of another type, fails the load.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path


def specforge_generator(file_path: str):
    """SpecForge's `safe_conversations_generator`, as of sgl-project/SpecForge `specforge/utils.py`."""
    with open(file_path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            turns = [{k: json.dumps(v, ensure_ascii=False) if isinstance(v, list | dict) else v
                      for k, v in turn.items()} for turn in row.get("conversations", [])]
            result = {"conversations": turns}
            if "tools" in row:
                tools = row["tools"]
                result["tools"] = json.dumps(tools, ensure_ascii=False) if tools is not None else []
            yield result


def load_first_record_decides(path: Path) -> list[dict]:
    """The rows as the trainer sees them; AssertionError naming the rows that would lose data (or the error)."""
    import datasets

    datasets.disable_progress_bars()
    expected = list(specforge_generator(str(path)))
    with tempfile.TemporaryDirectory() as cache:
        try:
            loaded = datasets.Dataset.from_generator(specforge_generator, gen_kwargs={"file_path": str(path)},
                                                     cache_dir=cache, writer_batch_size=1).to_list()
        except datasets.exceptions.DatasetGenerationError as exc:
            raise AssertionError(f"a first-record-decides loader fails on {path}: {exc.__cause__!r}") from exc
    lost = [i for i, (a, b) in enumerate(zip(expected, loaded, strict=True)) if a != b]
    assert not lost, (f"{len(lost)} of {len(expected)} rows lose data when the first record decides the "
                      f"columns ({sorted(expected[0])}); first: row {lost[0]}: {expected[lost[0]]} loaded as "
                      f"{loaded[lost[0]]}")
    return loaded
