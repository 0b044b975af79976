import errno
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
    return [publish.Part(tok, conv)], manifest


def test_publish_appears_complete_and_is_not_redone(tmp_path):
    parts, manifest = inputs(tmp_path)
    dest = tmp_path / "published" / "ds" / "v1"
    card = publish.dataset_card("ds", "v1", manifest)
    assert publish.publish(dest, parts, manifest, card) == dest
    assert sorted(p.name for p in dest.iterdir()) == ["README.md", "conversations.jsonl", "manifest.json",
                                                     "tokenized"]
    assert json.loads((dest / "manifest.json").read_text())["counts"]["published"] == 2
    stamp = (dest / "manifest.json").stat().st_mtime_ns
    publish.publish(dest, parts, {**manifest, "counts": {**manifest["counts"], "published": 99}}, card)
    assert (dest / "manifest.json").stat().st_mtime_ns == stamp
    assert not list(dest.parent.glob(".*"))


def test_the_card_says_how_many_samples_re_render_other_than_generated(tmp_path):
    _, manifest = inputs(tmp_path)
    assert "re-render" not in publish.dataset_card("ds", "v1", manifest)
    manifest["counts"]["rerender_differs"] = 3
    assert "3 samples re-render from their parsed fields" in publish.dataset_card("ds", "v1", manifest)


def test_the_card_reports_the_token_exact_turns_and_the_re_render_drift_by_cause(tmp_path):
    _, manifest = inputs(tmp_path)
    assert "Checked against the servers" not in publish.dataset_card("ds", "v1", manifest)  # no ids reported
    manifest["token_ids"] = {"prompt_ids_compared": 19, "prompt_ids_mismatch": 0, "token_exact": 19, "record_exact": 12,
                             "rerender_drift": {"compared": 19, "whitespace": 7, "tool_value": 5, "other": 0}}
    card = publish.dataset_card("ds", "v1", manifest)
    assert "19 samples' prompts were compared with the server's prompt token ids, 0 differ" in card
    assert "19 last assistant turns in `tokenized/` are the model's own output ids" in card
    assert "other ids for 12 of 19: 7 by whitespace, 5 by tool-call values re-typed, 0 other" in card
    assert "gets the model's ids on 12 of them" in card


def test_inconsistent_counts_publish_nothing(tmp_path):
    parts, manifest = inputs(tmp_path)
    manifest["counts"]["published"] = 3
    dest = tmp_path / "published" / "ds" / "v1"
    with pytest.raises(PublishRefused, match="refusing to publish"):
        publish.publish(dest, parts, manifest, "card")
    assert not dest.exists() and not list(dest.parent.iterdir())


def test_a_crash_mid_publish_leaves_no_visible_version_and_stale_tmp_is_cleaned(tmp_path):
    parts, manifest = inputs(tmp_path)
    parent = tmp_path / "published" / "ds"
    pid = os.fork()
    if pid == 0:  # the child dies (SIGKILL-like) in the middle of placing the shards
        real = publish.os.link
        publish.os.link = lambda *a: (real(*a), os._exit(9))
        publish.publish(parent / "v1", parts, manifest, "card")
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9
    assert not (parent / "v1").exists()
    assert len(publish.clean_stale_tmp(parent)) == 1 and not list(parent.iterdir())
    publish.publish(parent / "v1", parts, manifest, "card")
    assert (parent / "v1" / "manifest.json").is_file()


def test_shards_are_hard_linked_not_copied_and_copied_across_filesystems(tmp_path, monkeypatch, caplog):
    parts, manifest = inputs(tmp_path)
    dest = tmp_path / "published" / "ds" / "v1"
    publish.publish(dest, parts, manifest, "card")
    part = dest / "tokenized" / "part-00000.parquet"
    assert part.stat().st_ino == parts[0].tokens.stat().st_ino  # one copy on disk
    assert not list(tmp_path.glob("final"))

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(publish.os, "link", cross_device)
    with caplog.at_level("WARNING"):
        publish.publish(tmp_path / "elsewhere" / "ds" / "v1", parts, manifest, "card")
    copied = tmp_path / "elsewhere" / "ds" / "v1" / "tokenized" / "part-00000.parquet"
    assert copied.read_bytes() == parts[0].tokens.read_bytes() and copied.stat().st_ino != part.stat().st_ino
    assert "1 tokenized shards copied, not hard-linked" in caplog.text and "another filesystem" in caplog.text


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


def tokenized_run(tmp_path):
    """A run folder as tokenize and the quality gate leave it: shard 0 holds a quarantined sample, shard 1 none
    (its one answer holds U+2028, which str.splitlines splits at)."""
    from dflash_regen import atomic
    from dflash_regen.chat.conversation import specforge_record
    from dflash_regen.schemas import TOKENIZED

    run = RunLayout(tmp_path / "run")
    shards = {0: ["a", "b\"q", "c"], 1: ["d"]}
    for n, ids in shards.items():
        rows = [{"sample_id": i, "input_ids": [1, 2, k], "loss_mask": [0, 1, 1], "n_tokens": 3, "loss_mask_sum": 2}
                for k, i in enumerate(ids)]
        atomic.write_table(pa.Table.from_pylist(rows, schema=TOKENIZED), run.tokenized(n))
        turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "é\u2028ü"}]
        atomic.write_lines(run.conversations(n),
                           [json.dumps(specforge_record(i, turns, None), ensure_ascii=False) for i in ids])
        pq.write_table(pa.table({"sample_id": ids, "n_tokens": [3] * len(ids), "loss_mask_sum": [2] * len(ids),
                                 "reasoning_tokens": [0] * len(ids), "content_tokens": [2] * len(ids)}),
                       run.summary(n))
        run.results_dir(COMPLETIONS).mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"sample_id": ids, "server": ["s0"] * len(ids), "completion_tokens": [5] * len(ids),
                                 "latency_s": [1.0] * len(ids)}), run.merged(COMPLETIONS, n))
    run.planning_quarantine.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"sample_id": ["z"], "reason": ["bad_role"]}), run.planning_quarantine)
    run.gate_quarantine.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"sample_id": ["b\"q"], "reason": ["empty_answer_mask"]}), run.gate_quarantine)
    plan = {"rows": 5, "source": "p", "fingerprint": "f"}
    quality = {"success": True, "statistics": {}, "expectations": [],
               "quarantined_by_reason": {"empty_answer_mask": 1}}
    return run, plan, quality


def test_publish_run_writes_what_filtering_every_shard_wrote_and_stores_clean_shards_once(tmp_path):
    import pyarrow.compute as pc

    run, plan, quality = tokenized_run(tmp_path)
    dest = tmp_path / "published" / "ds" / "v1"
    manifest = publish.publish_run(run, dest, plan, quality, {}, tmp_path / "model")
    assert manifest["counts"] | {"quarantined_by_reason": None} == {
        "prompts": 5, "published": 3, "quarantined": 2, "quarantined_by_reason": None, "truncated_at_train_length": 0,
        "rerender_differs": 0}
    # The files as publish wrote them before: every shard read, filtered and rewritten, every line parsed.
    parts = []
    for n in (0, 1):
        table = pq.read_table(run.tokenized(n))
        sink = pa.BufferOutputStream()
        pq.write_table(table.filter(pc.invert(pc.is_in(table.column("sample_id"), pa.array(["b\"q"])))), sink)
        parts.append(sink.getvalue().to_pybytes())
    assert [(dest / "tokenized" / f"part-{n:05d}.parquet").read_bytes() for n in (0, 1)] == parts
    lines = [line for n in (0, 1) for line in
             run.conversations(n).read_bytes().split(b"\n") if line]
    assert (dest / "conversations.jsonl").read_bytes() == b"".join(
        line + b"\n" for line in lines if json.loads(line)["id"] != "b\"q")
    assert [json.loads(line)["id"] for line in (dest / "conversations.jsonl").read_bytes().splitlines()] \
        == ["a", "c", "d"]
    # the clean shard is the run's own file; the one with a quarantined sample a filtered copy; no final/ folder
    assert (dest / "tokenized" / "part-00001.parquet").stat().st_ino == \
        run.tokenized(1).stat().st_ino
    assert (dest / "tokenized" / "part-00000.parquet").stat().st_nlink == 1
    assert not (run.run_dir / "final").exists()


def test_publish_takes_validates_counts_and_refuses_a_quality_report_that_disagrees(tmp_path):
    from dflash_regen.errors import GateFailed
    from dflash_regen.settings.run_config import DEFAULTS, RunConfig

    cfg = RunConfig.from_params({**DEFAULTS, "output_root": str(tmp_path)}, "r1")
    cfg.layout.write_report("quality", {"success": True, "kept": 5, "quarantined": 1})
    with pytest.raises(PublishRefused, match=r"counts 5 kept, 1 quarantined but validate passed 4, 2"):
        publish.publish_validated(cfg, {"kept": 4, "quarantined": 2}, {}, tmp_path / "model")
    cfg.layout.write_report("quality", {"success": False, "kept": 4, "quarantined": 2})
    with pytest.raises(GateFailed, match="the quality report says the gate failed"):
        publish.publish_validated(cfg, {"kept": 4, "quarantined": 2}, {}, tmp_path / "model")
    assert not cfg.publish_dir.exists()
