"""SpecForge 0.2.0's own data code as a judge of a published `conversations.jsonl`, run in the side venv
(tests/specforge_check.py): `python specforge_judge.py <model dir> <max_length> <out.json> <conversations.jsonl>...`
(one verdict per file, in one process: the imports and the tokenizer are loaded once).

Nothing of SpecForge is copied here: each path calls SpecForge's functions with the settings its DFlash tools use
(template `qwen3.5`; `examples/configs/qwen3.6-27b-dflash-online.yaml` trains with max_length 4096):
- `parser`: `preprocess_conversations` (the `qwen3.5` template's ThinkingParser, `specforge/data/parse.py`) on
  each row as `json.loads` gives it, `tools` JSON-decoded when it is a string (as `build_eagle3_dataset` does);
- `online`: what `specforge train` runs (`data/prompt_builder.py`): `load_dataset("json")`, then
  `build_eagle3_dataset` with the DFlash minimum of 2 supervised tokens (`dflash_min_loss_tokens`);
- `offline`: what `scripts/prepare_hidden_states.py` runs: `Dataset.from_generator(safe_conversations_generator)`,
  then `build_eagle3_dataset` with DFlash's `has_consecutive_supervised_tokens` filter.
`build_eagle3_dataset` shuffles with seed 42 and drops `id`; the shuffle's permutation depends only on the row
count, so the judge recovers each output row's source line from the same shuffle of the line numbers.
`num_proc` is 1 (SpecForge's 8-32 workers change only the speed).

It also reads the file with the readers a user would try (`datasets` json, also in small chunks as a big file is
read, and pandas) and reports which rows come back other than `json.loads` gives them.
Output, per file: {"rows": n, "paths": {path: {id: [input_ids, loss_mask]}}, "dropped": {path: n},
"readers": {reader: [ids of rows read back differently]}, "versions": {...}}.
"""

from __future__ import annotations

import json
import sys
import tempfile


def _ids_masks(dataset) -> list[tuple[list[int], list[int]]]:
    return [(row["input_ids"].view(-1).tolist(), row["loss_mask"].view(-1).tolist()) for row in dataset]


def _order(n: int, seed: int = 42) -> list[int]:
    from datasets import Dataset

    return Dataset.from_dict({"line": list(range(n))}).shuffle(seed=seed)["line"]


def judge(path: str, model_dir: str, max_length: int) -> dict:
    """One file's verdict."""
    import datasets
    import pandas
    import specforge
    import torch
    import transformers
    from datasets import Dataset, load_dataset
    from specforge.data.loss_mask import has_consecutive_supervised_tokens
    from specforge.data.preprocessing import build_eagle3_dataset, preprocess_conversations
    from specforge.data.template import TEMPLATE_REGISTRY
    from specforge.utils import load_tokenizer, safe_conversations_generator

    datasets.disable_progress_bars()
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    ids = [r["id"] for r in rows]
    tokenizer = load_tokenizer(model_dir)
    template = TEMPLATE_REGISTRY.get("qwen3.5")
    paths: dict[str, dict] = {}

    parsed = []
    for r in rows:
        tools = json.loads(r["tools"]) if isinstance(r.get("tools"), str) else (r.get("tools") or [])
        out = preprocess_conversations(tokenizer, [r["conversations"]], template, max_length, tools=[tools])
        parsed.append((out["input_ids"][0].view(-1).tolist(), out["loss_mask"][0].view(-1).tolist()))
    paths["parser"] = dict(zip(ids, parsed, strict=True))

    online = load_dataset("json", data_files=path, split="train")
    built = build_eagle3_dataset(online, tokenizer, chat_template="qwen3.5", max_length=max_length, num_proc=None,
                                 minimum_valid_tokens=2)
    paths["online"] = _by_line(ids, built)

    with tempfile.TemporaryDirectory() as cache:
        offline = Dataset.from_generator(safe_conversations_generator, gen_kwargs={"file_path": path},
                                         cache_dir=cache)
        built = build_eagle3_dataset(offline, tokenizer, chat_template="qwen3.5", max_length=max_length,
                                     num_proc=None, loss_mask_filter=has_consecutive_supervised_tokens)
        paths["offline"] = _by_line(ids, built)

    readers = {
        "datasets": load_dataset("json", data_files=path, split="train").to_list(),
        # A big file is read in blocks whose types must agree (10 MB by default): 1 KB blocks show it on a small one.
        "datasets_chunked": _chunked(path),
        "pandas": pandas.read_json(path, lines=True, dtype=False).to_dict("records"),
    }
    return {"rows": len(rows), "paths": {k: {i: list(v) for i, v in p.items()} for k, p in paths.items()},
            "dropped": {k: len(rows) - len(p) for k, p in paths.items()},
            "readers": {k: _differ(rows, v) for k, v in readers.items()},
            "versions": {"specforge": _version("specforge"), "torch": torch.__version__,
                         "transformers": transformers.__version__, "datasets": datasets.__version__,
                         "pandas": pandas.__version__, "specforge_file": specforge.__file__}}


def _by_line(ids: list[str], built) -> dict:
    """Output rows by the id of their source line; with rows dropped the order is lost, so the result is short."""
    out = _ids_masks(built)
    if len(out) != len(ids):
        return {}
    return {ids[line]: row for line, row in zip(_order(len(ids)), out, strict=True)}


def _chunked(path: str) -> list[dict] | str:
    from datasets import load_dataset

    try:
        return load_dataset("json", data_files=path, split="train", chunksize=1024).to_list()
    except Exception as exc:  # the reader's failure is the measurement
        cause = exc.__cause__ or exc
        return f"{type(cause).__name__}: {str(cause)[:300]}"


def _differ(rows: list[dict], read: list[dict] | str) -> list[str] | str:
    if isinstance(read, str):
        return read
    return [r["id"] for r, back in zip(rows, read, strict=True) if json.dumps(r) != json.dumps(_plain(back))]


def _plain(value):
    """A read-back row as plain JSON values (pandas gives numpy scalars and arrays)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    model, length, out, *files = sys.argv[1:]
    verdicts = [judge(path, model, int(length)) for path in files]
    with open(out, "w", encoding="utf-8") as f:
        json.dump(verdicts, f)
