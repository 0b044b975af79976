"""The whole DAG, run by Airflow (`dag.test`) against emulated SGLang servers: the demo on seven in the newest
supported SGLang's mode, a small run in the oldest's. A gate failing with the teardown still run is fault case 5
(tests/faults/test_fault_matrix.py)."""

import json
import re
from pathlib import Path
from urllib.parse import quote

import pyarrow.parquet as pq
from conftest import FAST_PROFILE
from dag_helpers import assert_ran_in_versions_mode, check_invariants, layout_of, logs, states
from specforge_check import assert_specforge_reproduces, judged, published_tokens

from dflash_regen.layout import COMPLETIONS, FAILURES
from dflash_regen.sglang.api import NEWEST_CHECKED, OLDEST, Dialect


def test_demo_dag_runs_green_on_seven_emulated_servers(dag, run_params, no_leftover_servers):
    # In the newest supported SGLang's mode (the oldest's: the next test; the default's: every other test).
    # autotune advises within an 8 s budget (stopping the fleet counts in it: a loaded box can take seconds): the
    # current settings and at most one more are measured, the rest is over the budget
    # (tests/integration/test_autotune_on_fleet.py measures them all), then the fleet is relaunched.
    # Three shards (mapped tasks, and fewer tokenize tasks: each loads the tokenizer).
    conf = run_params(7, shard_size=40, emulator_profile={**FAST_PROFILE, "sglang_version": NEWEST_CHECKED},
                      autotune="advise", autotune_candidate_s=2.0, autotune_budget_s=8.0)
    dag_run = dag.test(run_conf=conf)
    assert states(dag_run) == {t: "success" for t in ("stage_weights", "launch_fleet", "health_check", "smoke_test",
                                                       "plan_shards", "autotune", "calibrate", "generate", "tokenize",
                                                       "validate", "publish", "stop_fleet", "check_published")}
    assert dag_run.state == "success"
    labels = sorted(ti.rendered_map_index for ti in dag_run.get_task_instances() if ti.task_id == "generate")
    assert labels[0] == "shard 0000 (40 prompts)" and len(labels) == 3
    run = layout_of(conf, dag_run)
    plan = json.loads(run.report("plan").read_text())
    completions = [sid for p in run.merged_files(COMPLETIONS)
                   for sid in pq.read_table(p, columns=["sample_id"]).column("sample_id").to_pylist()]
    failed = sum(pq.read_metadata(p).num_rows for p in run.merged_files(FAILURES))
    assert plan["rows"] == plan["accepted"] + plan["quarantined"] == 122
    assert plan["quarantined_by_reason"] == {"duplicate_id": 1, "bad_role": 1}
    tuned = json.loads(run.report("autotune").read_text())
    assert tuned["mode"] == "advise" and tuned["candidates"][0]["candidate"] == "current"
    assert "wall_s" in tuned["candidates"][0] and tuned["relaunch_s"] > 0  # measured, then the fleet came back
    assert any("over the total budget" in r.get("skipped", "") for r in tuned["candidates"])
    assert plan["formats"] == {"openai": 120} and plan["repairs"]["type_name"] == 72  # Python-style tool schemas
    assert len(completions) == len(set(completions)) and len(completions) + failed == plan["accepted"]
    health = json.loads(run.report("health").read_text())
    smoke = json.loads(run.report("smoke").read_text())
    assert health["passed"] and len(health["servers"]) == 7
    assert_ran_in_versions_mode(run, NEWEST_CHECKED)
    capacity = json.loads(run.report("capacity").read_text())
    assert capacity["run"]["prompts"] == plan["accepted"] and capacity["run"]["servers"] == 7
    # At the test profile's 20K tok/s per request the 2-core box itself can saturate first ("compute");
    # tests/integration/test_capacity_on_fleet.py checks the Mamba-bound advice on a known curve.
    assert capacity["binding"]["resource"] in ("Mamba slots", "compute") and capacity["scenarios"][0]["wall_s"] > 0
    assert smoke["passed"] and all(s["ok"] for s in smoke["servers"])
    assert sorted(run.fleet_dir.glob("*.log")) == [run.fleet.server_log(i) for i in range(7)]
    assert (Path(conf["staging_dir"]) / "config.json").is_file()
    # Published: complete, reconciled, and loadable as parquet.
    from dflash_regen.settings.run_config import safe_run_id

    version = Path(conf["output_root"]) / "published" / conf["dataset_name"] / safe_run_id(dag_run.run_id)
    manifest = json.loads((version / "manifest.json").read_text())
    c = manifest["counts"]
    assert c["prompts"] == 122 == c["published"] + c["quarantined"]
    assert c["quarantined_by_reason"]["duplicate_id"] == 1 and c["quarantined_by_reason"]["bad_role"] == 1
    from datasets import load_dataset

    from dflash_regen.chat.template import load_tokenizer

    tokenized = load_dataset("parquet", data_dir=str(version / "tokenized"), split="train")
    assert tokenized.num_rows == c["published"]
    tok = load_tokenizer(conf["staging_dir"])
    for row in tokenized.select(range(0, tokenized.num_rows, 10)):
        assert len(row["input_ids"]) == len(row["loss_mask"]) == row["n_tokens"]
        assert sum(row["loss_mask"]) == row["loss_mask_sum"] > conf["empty_mask_tokens"]
        supervised = tok.decode([i for i, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])
        assert "</think>" in supervised and supervised.endswith("<|im_end|>\n")
        assert "<|im_start|>user" not in supervised  # the prompt is never trained on
    conversations = load_dataset("json", data_files=str(version / "conversations.jsonl"), split="train")
    assert conversations.num_rows == c["published"]
    assert sorted(conversations["id"]) == sorted(tokenized["sample_id"])
    last = conversations[0]["conversations"][-1]
    assert last["role"] == "assistant" and last["reasoning_content"]
    # SpecForge's own parser, online and offline paths (tests/specforge_check.py) give our ids and masks on every row.
    [verdict] = judged([version / "conversations.jsonl"], Path(conf["staging_dir"]), conf["train_max_length"],
                       Path(conf["output_root"]) / "specforge-verdict.json")
    assert_specforge_reproduces(verdict, published_tokens(version), conf["train_max_length"])
    assert sum(json.loads(t) != [] for t in conversations["tools"]) > 0 and not any(verdict["readers"].values())
    # The tools as this SGLang version's server handed them to the template (0.5.23: a `defer_loading` on each).
    assert all(list(tool) == ["type", "function", "defer_loading"] for t in conversations["tools"]
               for tool in json.loads(t))
    # What the model saw is what the trainer renders, on every sample: the prompt the pipeline sent (its request),
    # its tools as SGLang 0.5.23 hands them to the template (`template_tools`, held against SGLang's own models in
    # tests/contract/test_sglang_contract.py), rendered by the template, is the start of the sample's input_ids.
    from dflash_regen.chat.template import _with_parsed_arguments
    from dflash_regen.generate.samples import chat_payload
    from dflash_regen.settings.run_config import RunConfig

    generation, dialect = RunConfig.from_params(conf, dag_run.run_id).generation, Dialect(NEWEST_CHECKED)
    sent = {r["sample_id"]: r for p in run.shard_files() for r in pq.read_table(p).to_pylist()}
    for row in tokenized:
        prompt = sent[row["sample_id"]]
        payload = chat_payload(json.loads(prompt["messages"]), json.loads(prompt["tools"]) if prompt["tools"] else None,
                               generation, seed=0, max_tokens=1)
        text = tok.apply_chat_template(_with_parsed_arguments(payload["messages"]), tokenize=False,
                                       tools=dialect.template_tools(payload.get("tools")), add_generation_prompt=True,
                                       **payload["chat_template_kwargs"])
        ids = tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
        assert row["input_ids"][:len(ids)] == ids and not any(row["loss_mask"][:len(ids)]), row["sample_id"]
    assert manifest["input"]["repairs"] == plan["repairs"] and "type_name 72" in (version / "README.md").read_text()
    assert run.data_docs_index.is_file()
    assert manifest["quality"]["success"] and manifest["storage"]["offline_hidden_states_tb"] > 0
    # The emulator writes the template's own form: every answer re-renders to the token count it generated.
    quality = json.loads(run.report("quality").read_text())
    assert quality["rerender_compared"] > 100
    assert quality["rerender_differs"] == manifest["counts"]["rerender_differs"] == 0
    # 0.5.23 streams the prompt's and the output's ids: every published sample's prompt is the server's, and its last
    # turn the emulator's own ids (through `<|im_end|>`, then the template's "\n"), token for token.
    generated = {r["sample_id"]: r for p in run.merged_files(COMPLETIONS) for r in pq.read_table(p).to_pylist()}
    newline = tok.backend_tokenizer.encode("\n", add_special_tokens=False).ids
    for row in tokenized:
        server = generated[row["sample_id"]]
        assert row["input_ids"] == server["server_prompt_ids"] + server["server_output_ids"] + newline
    ids = manifest["token_ids"]
    assert ids["prompt_ids_compared"] == quality["samples"] and ids["prompt_ids_mismatch"] == 0
    assert ids["token_exact"] >= c["published"] and ids["rerender_drift"]["compared"] == ids["token_exact"]
    assert ids["rerender_drift"] == {"compared": ids["token_exact"], "whitespace": 0, "tool_value": 0, "other": 0}
    assert ids["record_exact"] == ids["token_exact"]


def test_whole_dag_is_green_in_the_oldest_supported_sglangs_mode_on_loopback_and_never_logs_the_key(
        dag, run_params, no_leftover_servers, caplog, capfd, receivers):
    # The run's news to a local SMTP server and webhook (tests/notify_receivers.py); a progress message is due at
    # once (0.0001 h), and the one shard's end sends it.
    conf = run_params(2, shard_size=1000, calibration_prompts=0,  # one shard
                      emulator_profile={**FAST_PROFILE, "sglang_version": OLDEST}, **receivers.params(),
                      notify_progress_h=0.0001)
    dag_run = dag.test(run_conf=conf)
    assert dag_run.state == "success", states(dag_run)
    # Email and webhook got the same two messages, the progress and the publish (the DAG's success callback, which
    # dag.test runs itself): first line, the run's links, path, counts, verdict and wall time; never the API key.
    key = layout_of(conf, dag_run).fleet.api_key.read_text().strip()
    manifest = check_invariants(conf, dag_run, published=True)
    emails = [e.split("\n", 1)[1] for e in receivers.emails()]
    assert [e.split("\n", 1)[0] for e in receivers.emails()] == [f"Subject: {t.splitlines()[0]}" for t in emails]
    assert emails == receivers.posts() and len(emails) == 2, (emails, receivers.posts())
    progress, published = (text.splitlines() for text in emails)
    assert re.fullmatch(rf"Run {re.escape(dag_run.run_id)}: (\d+) of \1 prompts done \(100%\) after .+, ETA done",
                        progress[0]), progress[0]  # the one shard's end: every prompt done
    counts = manifest["counts"]
    assert published[0] == f"Run {dag_run.run_id} published {counts['published']:,} samples"
    assert published[1].endswith(f"/dags/dflash_regen/runs/{quote(dag_run.run_id, safe='')}")
    assert published[2].endswith(f"/dflash/runs/{quote(dag_run.run_id, safe='')}/fleet")
    version = Path(conf["output_root"]) / "published" / conf["dataset_name"]
    assert f"Dataset: {next(version.iterdir())}" in published
    assert f"Prompts {counts['prompts']:,} = published {counts['published']:,} + quarantined" in published[5]
    assert published[6].startswith("Quality gate passed: ") and published[7].startswith("Wall time: ")
    assert not any(key in text for text in emails + [m.as_string() for m in receivers.mailbox.messages])
    assert not {k for k in manifest["config"] if k.startswith("notify_")}  # an Apprise URL may hold a token
    assert_ran_in_versions_mode(layout_of(conf, dag_run), OLDEST)
    # Security: servers listen on loopback only, and the API key is in no log, spec or server log.
    fleet = layout_of(conf, dag_run).fleet
    key = fleet.api_key.read_text().strip()
    assert key not in logs(caplog, capfd)
    for spec in fleet.server_specs():
        record = json.loads(spec.read_text())
        assert record["host"] == "127.0.0.1" and key not in spec.read_text()
    for log in (fleet.server_log(i) for i in range(len(fleet.server_specs()))):
        assert key not in log.read_text()
    check_invariants(conf, dag_run, published=True)
