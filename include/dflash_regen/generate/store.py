"""The completion store: every completion a run on this output root checkpointed whole, found again by sample id
and the generation fingerprint, so a new run sends only what no earlier run answered with the same settings.

    <output_root>/store/<fingerprint>/fingerprint.json      the fields in the key; the first run's recorded ones
    <output_root>/store/<fingerprint>/<run>/<file>.parquet   hard links of that run's completion checkpoints
    <output_root>/store/<fingerprint>/rejected.json          files found unreadable or from other settings (by inode)

**No second copy.** Each store file is a hard link of a run's own checkpoint (a merged shard file, or the parts
of a shard that never merged): the same inode, no bytes of its own while the run folder keeps its link, and the
completions stay when a run folder is deleted. Checkpoints are written tmp + rename and never rewritten in place,
so a linked file cannot change under the store. `sync` links what runs have checkpointed since (failed, abandoned
and published runs alike), when a run plans; a run declares its fingerprint in `shards/generation.json`.

**The key.** A completion is reused when its sample id, its prompt's digest (the same id with other text is
another prompt) and the run's generation fingerprint match. In the fingerprint is what changes what the model
would answer; kept out, and recorded beside it, is what only changes how fast (`generation_fields`;
docs/operations.md, "Reuse across runs", says why each field is in or out).

**Safety.** Every file's footer and index columns are read and checked before its rows are trusted: an unreadable
one (partial, corrupt) or one whose rows carry other sampling values or seeds than the fingerprint's is never
reused; it is left out of the store (`rejected.json`), its samples are generated again, and the plan report says
so.

Placing what the store holds into a new run's checkpoints, when the run plans, is generate/run_plan.py's.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_regen import atomic
from dflash_regen.errors import ConfigError
from dflash_regen.layout import (
    COMPLETIONS,
    RunLayout,
    counted_files,
    runs_dir,
    shard_name,
    shard_of,
    store_dir,
)
from dflash_regen.prompts import planning
from dflash_regen.settings.run_config import RunConfig, sample_seed

log = logging.getLogger(__name__)

RECORD = "fingerprint.json"
REJECTED = "rejected.json"
PRUNED = "pruned.json"  # store/pruned.json: fingerprint -> run folders whose links a prune removed (not relinked)
SEED_RULE = "sha256(sample_id)[:8 hex] + seed mod 2^31"  # settings/run_config.py sample_seed; change both together
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Each row's own record of how it was sampled, checked against the fingerprint before it is reused.
_SAMPLING_COLUMNS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "enable_thinking")
_INDEX_COLUMNS = ["sample_id", "prompt_digest", "seed", *_SAMPLING_COLUMNS]


# ----------------------------------------------------------------------------------------------- the key
def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha(path: Path, cache: dict) -> str:
    """A file's SHA-256, cached by path, size and mtime (a 54 GB model is hashed once per output root)."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    if key not in cache:
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(16 * 1024 * 1024):
                h.update(chunk)
        cache[key] = h.hexdigest()
    return cache[key]


def model_identity(model_dir: Path, cache_file: Path) -> dict:
    """The model's part of the key: its weights (their checksums: `SHA256SUMS` when the dir has one, else computed
    once and cached), its chat template, config and tokenizer."""
    from dflash_regen.fleet.staging import read_manifest

    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model dir {model_dir} has no config.json here (Param model_source_dir): fix the path; "
                          "the completion store keys completions by the weights' checksums, read where plan_shards "
                          "runs, so a worker without the model dir needs it too, or Param reuse set to off")
    sums = read_manifest(model_dir)
    cache = json.loads(cache_file.read_text()) if cache_file.is_file() else {}
    weights = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    names = [p.relative_to(model_dir).as_posix() for p in weights]
    lines = [f"{name} {sums.get(name) or _file_sha(p, cache)}" for name, p in zip(names, weights, strict=True)]
    if not sums and weights:
        atomic.write_json(cache_file, cache)

    def text_sha(*names: str) -> str | None:
        found = [model_dir / n for n in names if (model_dir / n).is_file()]
        return _sha(b"".join(p.read_bytes() for p in found)) if found else None

    template = text_sha("chat_template.jinja")
    if template is None and (model_dir / "tokenizer_config.json").is_file():
        text = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
        template = _sha(json.dumps(text).encode()) if text else None
    return {"weights": _sha("\n".join(lines).encode()), "chat_template": template,
            "model_config": text_sha("config.json", "generation_config.json"), "tokenizer": text_sha("tokenizer.json")}


def _flag(flags: tuple[str, ...], name: str) -> str:
    return flags[flags.index(name) + 1] if name in flags[:-1] else ""


def generation_fields(cfg: RunConfig, model_dir: Path) -> tuple[dict, dict]:
    """(in the key, recorded only). In: everything that changes what the model would answer. Out: what changes only
    how fast or where it runs (speculative decoding, batch and cache flags, autotune, concurrency, shard size)."""
    s, g = cfg.sampling, cfg.generation
    fields = {
        **model_identity(model_dir, store_dir(cfg.output_root) / "checksums.json"),
        "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
        "presence_penalty": s.presence_penalty, "max_tokens": s.max_tokens, "enable_thinking": s.enable_thinking,
        "budget": f"train_length {g.train_budget}" if g.train_budget else "full",
        "retry_truncated": g.retry_truncated, "regenerate_history": g.regenerate_history,
        "seed": g.seed, "seed_rule": SEED_RULE,
        "reasoning_parser": g.reasoning_parser, "tool_call_parser": _flag(cfg.fleet.flags, "--tool-call-parser"),
    }
    recorded = {"server_command": cfg.fleet.server_command, "server_flags": " ".join(cfg.fleet.flags),
                "served_model_name": cfg.fleet.served_model_name, "num_servers": cfg.fleet.num_servers,
                "concurrency_per_server": g.concurrency_per_server, "autotune": cfg.autotune.mode,
                "shard_size": cfg.plan.shard_size,
                "emulator_profile": cfg.fleet.emulator_profile if cfg.fleet.is_emulator else None}
    return fields, recorded


def fingerprint(fields: dict) -> str:
    return _sha(json.dumps(fields, sort_keys=True).encode())[:16]


# ------------------------------------------------------------------------------------------- the index
@contextlib.contextmanager
def _locked(root: Path):
    """One writer of the store at a time (a run planning, a prune)."""
    folder = store_dir(root)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder


def _read_json(path: Path, default):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def _file_key(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def _store_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*.parquet"))


def sync(root: Path) -> int:
    """Link into the store every completion file a run has checkpointed and the store lacks; returns how many."""
    linked = 0
    with _locked(root) as store:
        have = {(p.stat().st_dev, p.stat().st_ino) for fp in store.glob("*") if fp.is_dir()
                for p in _store_files(fp)}
        pruned = _read_json(store / PRUNED, {})
        for run_dir in sorted(p for p in runs_dir(root).glob("*") if p.is_dir()):
            layout = RunLayout(run_dir)
            record = _read_json(layout.generation_record, None)
            if not record or run_dir.name in pruned.get(record["fingerprint"], []):
                continue  # planned before the store existed, never planned, or pruned
            folder = store / record["fingerprint"]
            if not (folder / RECORD).is_file():
                atomic.write_json(folder / RECORD, {k: record[k] for k in ("fingerprint", "fields", "recorded", "run")}
                                  | {"created": time.time()})
            rejected = _read_json(folder / REJECTED, {})
            results = layout.results_dir(COMPLETIONS)
            for n in sorted({shard_of(p) for p in results.glob("shard-*")}):
                merged, parts = layout.merged(COMPLETIONS, n), layout.parts(COMPLETIONS, n)
                for path in counted_files(merged, parts):  # the checkpoint rule: each row in one file
                    st = path.stat()
                    name = f"{shard_name(n)}.parquet" if path == merged else f"{shard_name(n)}--{path.name}"
                    target = folder / run_dir.name / name
                    if (st.st_dev, st.st_ino) in have or _file_key(path) in rejected:  # the same bad file, any name
                        continue
                    atomic.link(path, target)  # a link, never a copy
                    have.add((st.st_dev, st.st_ino))
                    linked += 1
                if merged.is_file():  # the merge holds every part's rows: the parts' links are superseded
                    for stale in (folder / run_dir.name).glob(f"{shard_name(n)}--part-*.parquet"):
                        stale.unlink()
    return linked


def _mismatch(table: pa.Table, fields: dict) -> str | None:
    """Why these rows were not made with `fields`' sampling and seeds, or None."""
    for column in _SAMPLING_COLUMNS:
        want = fields[column]
        values = table.column(column)
        if isinstance(want, bool):
            same = pc.all(pc.equal(values, want)).as_py()
        else:
            same = pc.all(pc.less_equal(pc.abs(pc.subtract(values.cast(pa.float64()), float(want))), 1e-6)).as_py()
        if same is False:
            seen = next(v for v in values.to_pylist() if v != want and not (isinstance(v, float) and
                                                                      abs(v - float(want)) <= 1e-6))
            seen = f"{seen:.6g}" if isinstance(seen, float) else seen
            return f"its rows were sampled with another {column} (e.g. {seen}, the key says {want})"
    ids, seeds = table.column("sample_id").to_pylist(), table.column("seed").to_pylist()
    bad = next((sid for sid, seed in zip(ids, seeds, strict=True) if seed != sample_seed(sid, fields["seed"])), None)
    if bad is not None:
        return f"sample {bad!r} was sent with another seed than run seed {fields['seed']} gives"
    if None in table.column("prompt_digest").to_pylist():
        return "its rows have no prompt digest (written before the store existed)"
    return None


def lookup(root: Path, print_: str, fields: dict) -> tuple[dict[str, tuple[Path, str]], list[dict]]:
    """sample_id -> (store file, prompt digest) of every completion the store holds under `print_`, each file read
    and checked first; and the problems found (files left out of the store, with why)."""
    found: dict[str, tuple[Path, str]] = {}
    problems: list[dict] = []
    with _locked(root) as store:
        folder = store / print_
        rejected = _read_json(folder / REJECTED, {})
        for path in _store_files(folder):
            try:
                table = pq.read_table(path, columns=_INDEX_COLUMNS)
                why = _mismatch(table, fields)
            except (OSError, pa.ArrowException, KeyError, ValueError) as exc:
                table, why = None, f"unreadable ({type(exc).__name__}: {str(exc)[:200]})"
            if why:
                rel = path.relative_to(folder).as_posix()
                problems.append({"file": str(path), "problem": why,
                                 "samples": pq.read_metadata(path).num_rows if "unreadable" not in why else None})
                rejected[_file_key(path)] = f"{rel}: {why}"
                path.unlink()
                log.warning("store: %s is not reused: %s; its samples are generated again", path, why)
                continue
            for sid, digest in zip(table.column("sample_id").to_pylist(), table.column("prompt_digest").to_pylist(),
                                   strict=True):
                found.setdefault(sid, (path, digest))
        if problems:
            atomic.write_json(folder / REJECTED, rejected)
    return found, problems


def why_nothing_reused(root: Path, print_: str, fields: dict, prompts: int) -> str:
    """One line: why the store had nothing for this run."""
    others = []
    for record_path in sorted(store_dir(root).glob(f"*/{RECORD}")):
        record = _read_json(record_path, None)
        if not record or record["fingerprint"] == print_:
            continue
        samples = sum(pq.read_metadata(p).num_rows for p in _store_files(record_path.parent))
        diff = {k: (record["fields"].get(k), v) for k, v in fields.items() if record["fields"].get(k) != v}
        others.append((len(diff), -samples, record, diff, samples))
    if not others:
        return (f"the store holds no completion of these {prompts:,} prompts under these settings (fingerprint "
                f"{print_}), and none under others")
    _, _, record, diff, samples = min(others, key=lambda o: o[:2])
    changed = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in sorted(diff.items()))
    return (f"the store's nearest completions ({samples:,} samples, fingerprint {record['fingerprint']}, first made by "
            f"run {record['run']}) were generated with other settings: {changed}; a completion is reused only under "
            "the same generation fingerprint")


def by_source_run(layout: RunLayout) -> dict[str, int]:
    """Completions this run holds, by the run that generated them."""
    sources: dict[str, int] = {}
    for path in layout.result_files(COMPLETIONS):
        for run in pq.read_table(path, columns=["source_run"]).column("source_run").to_pylist():
            sources[run] = sources.get(run, 0) + 1
    return sources


def provenance(layout: RunLayout) -> dict:
    """The manifest's `generation`: this run's fingerprint and its completions by the run that generated them."""
    record = _read_json(layout.generation_record, {})
    return {"fingerprint": record.get("fingerprint"), "fields": record.get("fields", {}),
            "by_source_run": by_source_run(layout)}


def nothing_to_generate(shards: list[dict]) -> str | None:
    """Why the run needs no fleet (the store holds every planned prompt's completion), or None."""
    if not shards or any(s.get("to_generate", s["prompts"]) for s in shards):
        return None
    return (f"nothing to generate: the completion store holds all {planning.accepted(shards):,} prompts' "
            "completions under this run's generation settings (reports/plan.json `reuse`), so no weights are "
            "staged and no server is launched or gated")


# ------------------------------------------------------------------------------------------ list, prune
def listing(root: Path) -> list[dict]:
    """Per fingerprint: its runs, samples, files and bytes (on disk: `own_bytes` are held by the store alone, the
    run folders that also link them being gone)."""
    out = []
    for folder in sorted(p for p in store_dir(root).glob("*") if p.is_dir()):
        record = _read_json(folder / RECORD, {})
        files = _store_files(folder)
        runs: dict[str, int] = {}
        for path in files:
            runs[path.parent.name] = runs.get(path.parent.name, 0) + pq.read_metadata(path).num_rows
        stats = [p.stat() for p in files]
        out.append({"fingerprint": folder.name, "runs": runs, "samples": sum(runs.values()), "files": len(files),
                    "bytes": sum(st.st_size for st in stats),
                    "own_bytes": sum(st.st_size for st in stats if st.st_nlink == 1),
                    "newest": max((st.st_mtime for st in stats), default=record.get("created", 0)),
                    "fields": record.get("fields", {})})
    return out


def prune(root: Path, *, fingerprint_: str | None = None, older_than_s: float | None = None) -> list[str]:
    """Remove a fingerprint's entries, or every fingerprint whose newest completion is older than `older_than_s`.
    Only the store's links go: a run folder's own files stay. Returns the fingerprints removed."""
    removed = []
    cutoff = time.time() - older_than_s if older_than_s is not None else None
    with _locked(root) as store:
        pruned = _read_json(store / PRUNED, {})
        for entry in listing(root):
            if (fingerprint_ and entry["fingerprint"] == fingerprint_) or \
                    (cutoff is not None and entry["newest"] < cutoff):
                shutil.rmtree(store / entry["fingerprint"])
                pruned[entry["fingerprint"]] = sorted(set(pruned.get(entry["fingerprint"], [])) | set(entry["runs"]))
                removed.append(entry["fingerprint"])
        atomic.write_json(store / PRUNED, pruned)
    return removed


# ---------------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    """`python -m dflash_regen.generate.store list|prune`: what the store holds; removing entries by
    fingerprint or age."""
    import argparse

    from dflash_regen.fleet.staging import human_bytes
    from dflash_regen.settings.deployment import deployment

    ap = argparse.ArgumentParser(prog="python -m dflash_regen.generate.store", description=main.__doc__)
    ap.add_argument("command", choices=("list", "prune"))
    ap.add_argument("--output-root", type=Path, default=Path(deployment().output_root),
                    help="the runs' output root (default: DFLASH_OUTPUT_ROOT or the demo's)")
    ap.add_argument("--fingerprint", help="prune: this fingerprint's entries")
    ap.add_argument("--older-than-days", type=float, help="prune: fingerprints with no completion newer than this")
    ap.add_argument("--json", action="store_true", help="list: as JSON")
    ns = ap.parse_args(argv)
    if ns.command == "prune":
        if not ns.fingerprint and ns.older_than_days is None:
            ap.error("prune needs --fingerprint FP or --older-than-days N")
        removed = prune(ns.output_root, fingerprint_=ns.fingerprint,
                        older_than_s=None if ns.older_than_days is None else ns.older_than_days * 86400)
        print(f"pruned {len(removed)} fingerprint(s): {', '.join(removed) or 'none matched'} "
              "(the runs' own files stay)")
        return 0
    entries = listing(ns.output_root)
    if ns.json:
        print(json.dumps(entries, indent=1))
        return 0
    print(f"completion store {store_dir(ns.output_root)}: {len(entries)} fingerprint(s)")
    for e in entries:
        f = e["fields"]
        print(f"{e['fingerprint']}  {e['samples']:,} samples in {e['files']} files, {human_bytes(e['bytes'])} linked "
              f"({human_bytes(e['own_bytes'])} held by the store alone), newest "
              f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(e['newest']))}")
        print(f"    temperature {f.get('temperature')} top_p {f.get('top_p')} top_k {f.get('top_k')} max_tokens "
              f"{f.get('max_tokens')} budget {f.get('budget')} thinking {f.get('enable_thinking')} "
              f"seed {f.get('seed')} weights {str(f.get('weights'))[:12]}")
        for run, n in sorted(e["runs"].items()):
            print(f"    run {run}: {n:,} samples")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
