import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_regen import publish
from dflash_regen.errors import PublishRefused
from dflash_regen.layout import COMPLETIONS, FAILURES, RunLayout


def inputs(tmp_path, rows=2):
    conv = tmp_path / "conv.jsonl"
    conv.write_text("".join(json.dumps({"id": f"s{i}", "conversations": []}) + "\n" for i in range(rows)))
    tok = tmp_path / "tok.parquet"
    pq.write_table(pa.table({"sample_id": [f"s{i}" for i in range(rows)]}), tok)
    manifest = {"counts": {"prompts": rows + 1, "published": rows, "quarantined": 1},
                "tokens": {"output": 10, "total": 20}, "config": {}, "storage": {"offline_hidden_states_tb": 0.0}}
    return conv, tok, manifest


def test_publish_appears_complete_and_is_not_redone(tmp_path):
    conv, tok, manifest = inputs(tmp_path)
    dest = tmp_path / "published" / "ds" / "v1"
    card = publish.dataset_card("ds", "v1", manifest)
    assert publish.publish(dest, [conv], [tok], manifest, card) == dest
    assert sorted(p.name for p in dest.iterdir()) == ["README.md", "conversations.jsonl", "manifest.json",
                                                     "tokenized"]
    assert json.loads((dest / "manifest.json").read_text())["counts"]["published"] == 2
    stamp = (dest / "manifest.json").stat().st_mtime_ns
    publish.publish(dest, [conv], [tok], {**manifest, "counts": {**manifest["counts"], "published": 99}}, card)
    assert (dest / "manifest.json").stat().st_mtime_ns == stamp
    assert not list(dest.parent.glob(".*"))


def test_inconsistent_counts_publish_nothing(tmp_path):
    conv, tok, manifest = inputs(tmp_path)
    manifest["counts"]["published"] = 3
    dest = tmp_path / "published" / "ds" / "v1"
    with pytest.raises(PublishRefused, match="refusing to publish"):
        publish.publish(dest, [conv], [tok], manifest, "card")
    assert not dest.exists() and not list(dest.parent.iterdir())


def test_a_crash_mid_publish_leaves_no_visible_version_and_stale_tmp_is_cleaned(tmp_path):
    conv, tok, manifest = inputs(tmp_path)
    parent = tmp_path / "published" / "ds"
    pid = os.fork()
    if pid == 0:  # the child dies (SIGKILL-like) in the middle of copying
        real = publish.shutil.copyfile
        publish.shutil.copyfile = lambda *a: (real(*a), os._exit(9))
        publish.publish(parent / "v1", [conv], [tok], manifest, "card")
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9
    assert not (parent / "v1").exists()
    assert len(publish.clean_stale_tmp(parent)) == 1 and not list(parent.iterdir())
    publish.publish(parent / "v1", [conv], [tok], manifest, "card")
    assert (parent / "v1" / "manifest.json").is_file()


def test_hidden_state_estimate_matches_the_seeds_order_of_magnitude():
    assert 80 < publish.hidden_state_bytes(1_640_000_000) / 1e12 < 95


def test_publish_run_refuses_counts_that_do_not_reconcile(tmp_path):
    # 5 prompts planned, but the run's files account for 3 published + 1 quarantined: one sample is lost.
    run = RunLayout(tmp_path / "run")
    for folder in (run.tokenized_dir, run.results_dir(FAILURES), run.results_dir(COMPLETIONS)):
        folder.mkdir(parents=True)
    ids = ["a", "b", "c"]
    pq.write_table(pa.table({"sample_id": ids, "n_tokens": [10] * 3}), run.tokenized(0))
    run.conversations(0).write_text(
        "".join(json.dumps({"id": i, "conversations": []}) + "\n" for i in ids))
    pq.write_table(pa.table({"sample_id": ids, "server": ["s0"] * 3, "completion_tokens": [5] * 3,
                             "latency_s": [1.0] * 3}), run.merged(COMPLETIONS, 0))
    pq.write_table(pa.table({"location": ["p:4"], "stage": ["plan"], "reason": ["bad_role"], "detail": ["x"],
                             "sample_id": ["d"]}), run.planning_quarantine)
    plan = {"rows": 5, "source": "p", "fingerprint": "f"}
    quality = {"success": True, "statistics": {}, "expectations": [], "quarantined_by_reason": {}}
    dest = tmp_path / "published" / "ds" / "v1"
    with pytest.raises(PublishRefused, match=r"counts do not reconcile: 5 prompts but 3 published \+ 1 quarantined"):
        publish.publish_run(run, dest, plan, quality, {}, tmp_path / "model")
    assert not dest.exists()
