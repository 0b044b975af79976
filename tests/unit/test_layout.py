"""The run layout: where each node's and each run's files are, and the checkpoint rule (merged file + parts)."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_regen.layout import COMPLETIONS, FAILURES, FleetFiles, RunLayout, counted_files, shard_of, shard_sources
from dflash_regen.settings.run_config import DEFAULTS, RunConfig


def rows(path, *ids):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"sample_id": list(ids)}), path)


def ids_in(paths):
    return sorted(i for p in paths for i in pq.read_table(p).column("sample_id").to_pylist())


def test_a_node_has_its_own_fleet_reports_and_autotune_and_shares_the_rest_of_the_run(tmp_path):
    one, node = RunLayout.of(tmp_path, "r1"), RunLayout.of(tmp_path, "r1", node="gpu-b")
    run = tmp_path / "runs" / "r1"
    assert one.run_dir == node.run_dir == run
    assert (one.fleet_dir, node.fleet_dir) == (run / "fleet", run / "fleet" / "gpu-b")
    assert (one.node_reports_dir, node.node_reports_dir) == (run / "reports", run / "reports" / "nodes" / "gpu-b")
    assert node.node_report("health") == run / "reports" / "nodes" / "gpu-b" / "health.json"
    assert node.node_report("health", "gpu-a") == run / "reports" / "nodes" / "gpu-a" / "health.json"
    assert node.autotune_candidate(2) == run / "autotune" / "gpu-b" / "candidate-2"
    for name in ("plan", "quality", "assignment"):  # reports of the whole run are never per node
        assert node.report(name) == one.report(name) == run / "reports" / f"{name}.json"
    assert node.shard(3) == one.shard(3) == run / "shards" / "shard-00003.parquet"
    assert node.merged(COMPLETIONS, 3) == run / "completions" / "shard-00003.parquet"
    assert node.parts(FAILURES, 3) == run / "failures" / "shard-00003"
    assert node.status(3) == run / "status" / "shard-00003.json"
    assert (node.tokenized(3), node.summary(3), node.conversations(3)) == (
        run / "tokenized" / "shard-00003.parquet", run / "tokenized" / "summary-00003.parquet",
        run / "tokenized" / "conversations-00003.jsonl")
    assert node.fleet.failed_shard(3) == run / "fleet" / "gpu-b" / "failed-shard-00003.json"


def test_run_config_paths_are_its_layouts(run_params):
    cfg = RunConfig.from_params(run_params(), "manual__2026-01-01T00:00:00+00:00", node="gpu-b")
    assert cfg.layout == RunLayout.of(cfg.output_root, cfg.run_id, "gpu-b")
    assert (cfg.run_dir, cfg.fleet_dir, cfg.reports_dir, cfg.node_reports_dir) == (
        cfg.layout.run_dir, cfg.layout.fleet_dir, cfg.layout.reports_dir, cfg.layout.node_reports_dir)
    assert cfg.fleet_dir.parent.name == "fleet" and cfg.run_dir.parent.name == "runs"


def test_a_merged_shard_file_wins_over_its_leftover_parts(tmp_path):
    run = RunLayout(tmp_path)
    rows(run.merged(COMPLETIONS, 0), "a", "b", "c")
    rows(run.parts(COMPLETIONS, 0) / "part-1.parquet", "a", "b")  # a kill between the merge's rename and unlinks
    assert run.result_files(COMPLETIONS) == run.result_files(COMPLETIONS, 0) == [run.merged(COMPLETIONS, 0)]
    assert counted_files(run.merged(COMPLETIONS, 0), run.parts(COMPLETIONS, 0)) == [run.merged(COMPLETIONS, 0)]
    # what a merge reads (and a resume takes ids from, as a set): everything on disk, merged file first
    assert shard_sources(run.merged(COMPLETIONS, 0), run.parts(COMPLETIONS, 0)) == [
        run.merged(COMPLETIONS, 0), run.parts(COMPLETIONS, 0) / "part-1.parquet"]


def test_the_parts_of_shards_not_merged_yet_count_and_nothing_is_counted_twice(tmp_path):
    run = RunLayout(tmp_path)
    rows(run.merged(COMPLETIONS, 0), "a", "b")
    rows(run.parts(COMPLETIONS, 0) / "part-1.parquet", "a")
    rows(run.parts(COMPLETIONS, 1) / "part-1.parquet", "c")
    rows(run.parts(COMPLETIONS, 1) / "part-2.parquet", "d", "e")
    (run.parts(COMPLETIONS, 1) / ".part-3.parquet.123-0a1b2c3d.tmp").write_bytes(b"half written")  # atomic's temp name
    rows(run.merged(FAILURES, 2), "x")  # another kind: not a completion
    rows(run.planning_quarantine, "p")
    assert ids_in(run.result_files(COMPLETIONS)) == ["a", "b", "c", "d", "e"]
    assert ids_in(run.result_files(COMPLETIONS, 1)) == ["c", "d", "e"]
    assert ids_in(run.result_files(FAILURES)) == ["x"]  # planning's quarantine is no shard's checkpoint
    assert run.failure_files() == [run.planning_quarantine, run.merged(FAILURES, 2)]
    assert [shard_of(p) for p in run.result_files(COMPLETIONS)] == [0, 1, 1]
    assert run.result_files(COMPLETIONS, 7) == [] and RunLayout(tmp_path / "none").result_files(FAILURES) == []


def test_shard_files_name_their_shard_and_other_files_are_refused(tmp_path):
    run = RunLayout(tmp_path)
    for path in (run.shard(12), run.merged(FAILURES, 12), run.parts(COMPLETIONS, 12) / "part-0001-ab.parquet",
                 run.summary(12), run.conversations(12), run.status(12)):
        assert shard_of(path) == 12, path
    with pytest.raises(ValueError, match="is not a shard's file"):
        shard_of(run.planning_quarantine)
    with pytest.raises(ValueError, match="no shard results of kind 'tokenized'"):
        run.results_dir("tokenized")


def test_readers_find_every_fleet_of_a_run_and_every_server_by_index(tmp_path):
    run = RunLayout(tmp_path)
    fleet = FleetFiles(run.run_dir / "fleet" / "gpu-a")
    for i in (10, 2, 0):
        fleet.server_spec(i).parent.mkdir(parents=True, exist_ok=True)
        fleet.server_spec(i).write_text("{}")
    fleet.unhealthy(2).write_text("stopped answering")
    fleet.exit_record(0).write_text("{}")
    assert run.fleet_dirs() == [run.run_dir / "fleet", fleet.dir]
    assert [p.name for p in fleet.server_specs()] == ["server-0.json", "server-2.json", "server-10.json"]
    assert [p.name for p in fleet.launch_markers()] == ["unhealthy-2", "exit-0.json"]
    assert RunLayout(tmp_path, node="gpu-a").fleet == fleet


def test_a_report_is_written_per_node_when_it_is_the_fleets_and_per_run_otherwise(tmp_path):
    node = RunLayout.of(tmp_path, "r1", node="gpu-b")
    assert node.write_report("health", {"passed": True}) == node.node_report("health")
    assert node.write_report("quality", {"success": True}) == node.report("quality")
    assert node.node_report("health").is_file() and node.report("quality").is_file()
    assert not node.report("health").exists()  # never the run's own for a fleet report


def test_the_output_roots_own_folders_and_files_have_one_home(tmp_path):
    from dflash_regen import layout

    assert layout.run_lock(tmp_path) == tmp_path / "run.lock"
    assert layout.publish_dir(tmp_path, "ds", "r1") == tmp_path / "published" / "ds" / "r1"
    version = layout.publish_dir(tmp_path, "ds", "r1")
    version.mkdir(parents=True)
    layout.manifest(version).write_text("{}")
    assert layout.published_manifests(tmp_path, "r1") == [version / "manifest.json"]
    assert layout.published_manifests(tmp_path, "r2") == []
    cfg = RunConfig.from_params({**DEFAULTS, "output_root": str(tmp_path), "dataset_name": "ds"}, "r1")
    assert cfg.publish_dir == version
