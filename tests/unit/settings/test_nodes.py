"""Deployment nodes (DFLASH_NODES) and the split of a run's shards among them."""

import json

import pytest

from dflash_regen.errors import ConfigError
from dflash_regen.layout import RunLayout
from dflash_regen.settings import nodes


def shards(*sizes):
    return [{"shard": i, "prompts": n, "path": f"/x/shard-{i}"} for i, n in enumerate(sizes)]


def test_unset_means_one_node():
    assert nodes.parse_nodes(None) == [] and nodes.parse_nodes("  ") == []


def test_a_node_overrides_only_the_params_it_names():
    (rtx, b200) = nodes.parse_nodes(json.dumps([
        {"name": "rtx", "queue": "gpu-node-1", "gpus": "0, 1,2,3", "base_port": 31000},
        {"name": "b200", "queue": "gpu-node-2", "staging_dir": "/dev/shm/q", "emulator_profile": {"x": 1}}]))
    params = {"num_servers": 7, "gpu_ids": "", "base_port": 30000, "staging_dir": "", "server_command": "emulator",
              "emulator_profile": {}}
    assert rtx.apply(params) == {**params, "num_servers": 4, "gpu_ids": "0,1,2,3", "base_port": 31000}
    assert b200.apply(params) == {**params, "staging_dir": "/dev/shm/q", "emulator_profile": {"x": 1}}
    assert nodes.Node(**rtx.to_dict()) == rtx


@pytest.mark.parametrize("text, says", [
    ("{", "not JSON"),
    ("[]", "not a non-empty list"),
    ('[{"queue": "q"}]', "with a 'name'"),
    ('[{"name": "a"}, {"name": "a"}]', "is not unique"),
    ('[{"name": "a b"}]', "is not unique letters"),
    ('[{"name": "a", "gpu": "0"}]', "unknown fields ['gpu']"),
    ('[{"name": "a", "gpus": "0;1"}]', "not comma-separated GPU numbers"),
    ('[{"name": "a", "base_port": "30000"}]', "is not a port number"),
])
def test_a_bad_node_list_names_the_variable_the_node_and_the_fix(text, says):
    with pytest.raises(ConfigError) as err:
        nodes.parse_nodes(text)
    assert str(err.value).startswith("environment variable DFLASH_NODES is invalid") and says in str(err.value)
    assert "JSON list of nodes" in str(err.value)


def test_shards_go_to_nodes_in_proportion_to_their_rate():
    split = nodes.assign(shards(*[10] * 12), {"rtx": 1.0, "b200": 3.0})
    assert [len(split["rtx"]), len(split["b200"])] == [3, 9]
    assert [s["shard"] for s in split["b200"]] == sorted(s["shard"] for s in split["b200"])


def test_the_split_is_within_one_shard_of_proportional_for_uneven_shards():
    work = shards(15, 15, 15, 15, 15, 15, 15, 13)
    rates = {"fast": 2.7, "slow": 1.0}
    split = nodes.assign(work, rates)
    total = sum(s["prompts"] for s in work)
    for name, rate in rates.items():
        got = sum(s["prompts"] for s in split[name])
        assert abs(got - total * rate / sum(rates.values())) <= 15
    assert sorted(s["shard"] for part in split.values() for s in part) == list(range(8))


def test_a_node_too_slow_for_even_one_shard_gets_none():
    assert nodes.assign(shards(10, 10), {"fast": 100.0, "slow": 1.0}) == {"fast": shards(10, 10), "slow": []}
    with pytest.raises(ValueError):
        nodes.assign(shards(10), {"a": 0.0})


def test_split_report_measures_each_node_from_its_shards_attempts(tmp_path):
    layout = RunLayout(tmp_path)
    layout.reports_dir.mkdir()
    layout.status_dir.mkdir()
    layout.report("assignment").write_text(json.dumps({
        "basis": "calibrated prompts/s", "left_out": {}, "nodes": {
            "a": {"shards": [0, 1], "prompts": 20, "predicted_s": 10.0, "servers": 2},
            "b": {"shards": [2], "prompts": 10, "predicted_s": 12.0, "servers": 1}}}))
    for shard, attempts in {0: [(100, 104)], 1: [(101, 103), (105, 111)], 2: [(100, 113)]}.items():
        layout.status(shard).write_text(json.dumps({
            "state": "done", "done": 10,
            "attempts": [{"started_at": a, "updated_at": b, "ended_at": b} for a, b in attempts]}))
    report = nodes.split_report(layout)
    # a: 2 servers, busy 4 + 2 + 6 s; wall from its first start (100) to its last end (111)
    assert report["nodes"]["a"] == {"shards": [0, 1], "prompts": 20, "predicted_s": 10.0, "servers": 2,
                                    "measured_s": 11, "generating_s": 6.0, "done": 20}
    assert report["nodes"]["b"]["measured_s"] == 13 and report["nodes"]["b"]["done"] == 10
    assert nodes.split_report(RunLayout(tmp_path / "nowhere")) is None
