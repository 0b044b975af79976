"""Helpers for tests that run the whole DAG with dag.test()."""

import json
from pathlib import Path

import pyarrow.parquet as pq

from dflash_regen.layout import COMPLETIONS, RunLayout
from dflash_regen.sglang.api import OLDEST, Dialect


def states(dag_run) -> dict[str, str]:
    """Task id -> state; a mapped task's state is the set of its instances' states."""
    got: dict[str, set] = {}
    for ti in dag_run.get_task_instances():
        got.setdefault(ti.task_id, set()).add(ti.state)
    return {task: ",".join(sorted(s)) for task, s in got.items()}


def layout_of(conf, dag_run) -> RunLayout:
    """The RunLayout of a dag.test() run."""
    from dflash_regen.settings.run_config import safe_run_id

    return RunLayout.of(Path(conf["output_root"]), safe_run_id(dag_run.run_id))


def logs(caplog, capfd) -> str:
    """What the tasks logged: stdlib records, plus the task runner's structlog lines (failures) on stdout/err."""
    out, err = capfd.readouterr()
    capfd.seen = getattr(capfd, "seen", "") + out + err  # readouterr() consumes: keep what was read
    return caplog.text + capfd.seen


def published_versions(conf) -> list[Path]:
    root = Path(conf["output_root"]) / "published" / conf["dataset_name"]
    return sorted(root.iterdir()) if root.is_dir() else []


def check_invariants(conf, dag_run, *, published: bool) -> dict:
    """What every fault case checks from the files on disk: no sample id twice, every quarantined row has a
    reason, and either no published version or exactly one whose counts reconcile and hold no API key."""
    run = layout_of(conf, dag_run)
    ids = [sid for p in run.merged_files(COMPLETIONS)
           for sid in pq.read_table(p, columns=["sample_id"]).column("sample_id").to_pylist()]
    assert len(ids) == len(set(ids)), "a sample was generated twice"
    quarantine = run.failure_files() + [p for p in [run.gate_quarantine] if p.is_file()]
    for path in quarantine:
        reasons = pq.read_table(path, columns=["reason"]).column("reason").to_pylist()
        assert all(reasons), f"a quarantined row in {path} has no reason"
    versions = published_versions(conf)
    assert not [v for v in versions if v.name.startswith(".")], "a half-written version is visible"
    if not published:
        assert versions == []
        return {}
    assert len(versions) == 1
    manifest = json.loads((versions[0] / "manifest.json").read_text())
    c = manifest["counts"]
    assert c["prompts"] == c["published"] + c["quarantined"]
    assert pq.read_table(versions[0] / "tokenized").num_rows == c["published"]
    key = run.fleet.api_key.read_text().strip()
    assert key not in (versions[0] / "manifest.json").read_text()
    return manifest


def assert_ran_in_versions_mode(run: RunLayout, version: str) -> None:
    """The launcher built that version's argv and env, and health_check found the Mamba binding although
    /server_info's top-level max_mamba_cache_size is null (the CLI echo) in every version."""
    health = json.loads(run.report("health").read_text())
    assert all(s["version"] == version and s["binding"] == "Mamba slots (80 // 5 = 16)" for s in health["servers"])
    spec = json.loads(run.fleet.server_spec(0).read_text())
    assert Dialect(version).mamba_strategy_flag in spec["argv"]
    assert ("SGLANG_ENABLE_SPEC_V2" in spec["env"]) == (version == OLDEST)
