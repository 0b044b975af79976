"""The completion store without a fleet: what is in the generation fingerprint and what is not, files from other
settings never reused, the CLI's list and prune. The whole DAG's reuse is tests/e2e/test_reuse.py."""

import json
import os
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_regen.demo.model import write_demo_model
from dflash_regen.generate import run_plan, store
from dflash_regen.layout import COMPLETIONS, store_dir
from dflash_regen.prompts import planning
from dflash_regen.prompts.formats import prompt_digest
from dflash_regen.schemas import COMPLETION
from dflash_regen.settings.run_config import DEFAULTS, RunConfig, sample_seed


@pytest.fixture
def model(tmp_path) -> Path:
    return write_demo_model(tmp_path / "model")


def config(tmp_path, run: str, **params) -> RunConfig:
    return RunConfig.from_params({**DEFAULTS, "output_root": str(tmp_path / "out"), "server_command": "emulator",
                                  **params}, run)


def key(cfg: RunConfig, model: Path) -> str:
    return store.fingerprint(store.generation_fields(cfg, model)[0])


def test_speed_settings_stay_out_of_the_fingerprint_and_what_changes_answers_is_in(tmp_path, model):
    base = key(config(tmp_path, "a"), model)
    # how fast, on how many servers, in what shards: the same answers
    assert key(config(tmp_path, "b", server_flags="--speculative-algorithm off --max-running-requests 64",
                      concurrency_per_server=8, shard_size=7, num_servers=3, autotune="apply"), model) == base
    for change in ({"temperature": 0.7}, {"top_p": 0.9}, {"top_k": 40}, {"min_p": 0.1}, {"presence_penalty": 1.0},
                   {"max_tokens": 8192}, {"budget": "train_length"}, {"enable_thinking": False},
                   {"regenerate_history": True}, {"seed": 1}, {"retry_truncated": True},
                   {"server_flags": "--reasoning-parser deepseek-r1"}):
        assert key(config(tmp_path, "b", **change), model) != base, change
    # other weights (their checksums) or another chat template
    weights = sorted(model.glob("*.safetensors"))[0]
    (model / "SHA256SUMS").write_text((model / "SHA256SUMS").read_text().replace(
        next(line.split()[0] for line in (model / "SHA256SUMS").read_text().splitlines() if weights.name in line),
        "0" * 64))
    assert key(config(tmp_path, "a"), model) != base
    other = write_demo_model(tmp_path / "model2")
    base2 = key(config(tmp_path, "a"), other)
    (other / "chat_template.jinja").write_text("{{ messages }}")
    assert key(config(tmp_path, "a"), other) != base2


def plan(tmp_path, cfg: RunConfig, prompts: int, edited: int | None = None) -> list[dict]:
    """Prompts p0.. of `prompts`; `edited`: that one keeps its id but asks something else."""
    source = tmp_path / f"prompts-{prompts}-{edited}.jsonl"
    source.write_text("".join(json.dumps({"id": f"p{i}", "messages": [
        {"role": "user", "content": f"q {i}" + (" (edited)" if i == edited else "")}]}) + "\n" for i in range(prompts)))
    return [dict(s) for s in planning.plan_shards(source, cfg.layout, replace(cfg.plan, shard_size=4))["shards"]]


def answer(cfg: RunConfig, shards: list[dict], temperature: float | None = None) -> None:
    """Completions of every planned prompt, as generate writes them (a merged file per shard)."""
    for shard in shards:
        rows = [{"sample_id": r["sample_id"], "shard": shard["shard"], "content": f"answer {r['sample_id']}",
                 "temperature": cfg.sampling.temperature if temperature is None else temperature,
                 "top_p": cfg.sampling.top_p, "top_k": cfg.sampling.top_k, "min_p": cfg.sampling.min_p,
                 "presence_penalty": cfg.sampling.presence_penalty, "enable_thinking": cfg.sampling.enable_thinking,
                 "seed": sample_seed(r["sample_id"], cfg.generation.seed), "source_run": cfg.run_id,
                 "prompt_digest": prompt_digest(r["messages"], r["tools"])}
                for r in pq.read_table(shard["path"]).to_pylist()]
        path = cfg.layout.merged(COMPLETIONS, shard["shard"])
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows, schema=COMPLETION), path)


def test_a_rerun_links_whole_shards_and_never_reuses_rows_made_with_other_settings(tmp_path, model):
    a = config(tmp_path, "a")
    shards_a = plan(tmp_path, a, 8)
    run_plan.plan_reuse(a, shards_a, model)
    answer(a, shards_a)
    # run x claims a's fingerprint but its rows were sampled at another temperature (a copied-in folder)
    x = config(tmp_path, "x")
    shards_x = plan(tmp_path, x, 12)
    run_plan.plan_reuse(x, shards_x, model)
    answer(x, shards_x[2:], temperature=0.9)  # p8..p11
    b = config(tmp_path, "b")
    shards_b = plan(tmp_path, b, 12)
    report = run_plan.plan_reuse(b, shards_b, model)
    assert report["reused"] == 8 and report["to_generate"] == 4 and [s["to_generate"] for s in shards_b] == [0, 0, 4]
    assert report["whole_shards_linked"] == 2 and report["by_source_run"] == {"a": 8}
    assert [p["problem"] for p in report["problems"]] == [
        "its rows were sampled with another temperature (e.g. 0.9, the key says 0.6)"]
    for n in (0, 1):  # the same file, not a copy
        assert os.path.samefile(b.layout.merged(COMPLETIONS, n), a.layout.merged(COMPLETIONS, n))
    assert not b.layout.merged(COMPLETIONS, 2).exists()  # left to generate
    # planned again (a retry), nothing is placed twice and the rejected file stays out
    again = run_plan.plan_reuse(b, [dict(s) for s in shards_b], model)
    assert again["reused"] == 0 and again["problems"] == [] and again["by_source_run"] == {"a": 8}
    # an id given other text is another prompt: its completion is not reused
    d = config(tmp_path, "d")
    edited = run_plan.plan_reuse(d, plan(tmp_path, d, 8, edited=5), model)
    assert edited["reused"] == 7 and edited["other_prompt_text"] == 1 and edited["to_generate"] == 1
    # with Param reuse off nothing is taken, and the report says why
    off = config(tmp_path, "c", reuse="off")
    assert run_plan.plan_reuse(off, plan(tmp_path, off, 8), model)["why_none"] == "Param reuse is off"


def test_the_cli_lists_fingerprints_runs_samples_and_bytes_and_prunes_for_good(tmp_path, model, capsys):
    a = config(tmp_path, "a")
    shards = plan(tmp_path, a, 8)
    run_plan.plan_reuse(a, shards, model)
    answer(a, shards)
    store.sync(a.output_root)
    root = str(a.output_root)
    assert store.main(["list", "--output-root", root, "--json"]) == 0
    [entry] = json.loads(capsys.readouterr().out)
    assert entry["runs"] == {"a": 8} and entry["samples"] == 8 and entry["files"] == 2
    assert entry["bytes"] == sum(p.stat().st_size for p in a.layout.merged_files(COMPLETIONS))
    assert entry["own_bytes"] == 0  # hard links of a's files: no second copy
    assert store.main(["list", "--output-root", root]) == 0
    assert f"{entry['fingerprint']}  8 samples in 2 files" in capsys.readouterr().out
    assert store.main(["prune", "--output-root", root, "--older-than-days", "1"]) == 0
    assert "pruned 0 fingerprint(s)" in capsys.readouterr().out
    assert store.main(["prune", "--output-root", root, "--fingerprint", entry["fingerprint"]]) == 0
    assert not (store_dir(a.output_root) / entry["fingerprint"]).exists()
    assert all(p.is_file() for p in a.layout.merged_files(COMPLETIONS))  # the run's own files stay
    b = config(tmp_path, "b")
    assert run_plan.plan_reuse(b, plan(tmp_path, b, 8), model)["reused"] == 0  # pruned stays pruned


def test_without_the_model_dir_where_planning_runs_reuse_fails_clearly_and_off_indexes_nothing(tmp_path):
    from dflash_regen.errors import ConfigError

    a = config(tmp_path, "a")
    with pytest.raises(ConfigError, match=r"has no config.json here \(Param model_source_dir\): fix the path"):
        run_plan.plan_reuse(a, plan(tmp_path, a, 4), tmp_path / "no-model")
    off = config(tmp_path, "b", reuse="off")
    report = run_plan.plan_reuse(off, plan(tmp_path, off, 4), tmp_path / "no-model")
    assert report["to_generate"] == 4 and not off.layout.generation_record.exists()
