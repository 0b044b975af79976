"""The seed's size, rehearsed (issue 38): the whole DAG under a real scheduler at N prompts and at N/10, each
followed by a rerun on the same output root with only a gate Param changed.

For each size (N/10 first, then N), in one process:
1. **Pieces without the DAG**: planning with the real template count (Param budget train_length: every
   prompt is rendered and counted), in a child process (its wall, CPU and peak RSS from `os.wait4`).
2. **The DAG** under a real Airflow (tests/live_airflow.py: the api-server, scheduler and dag-processor
   `airflow standalone` starts, LocalExecutor, SQLite) on 7 emulated servers answering short outputs at zero
   latency (so the CPU, not the emulator, is measured). Prompts resemble the seed's mix: single-turn,
   multi-turn, tool calls (with assistant tool calls and tool results), ~4.5% bad rows (duplicates, bad
   roles, empty turns). 1% of prompts loop until max_tokens (emulator fault `loop_rate`), and the first run
   sets `max_truncated_share` below that, so it **fails at `validate`**, at the end; the rerun changes only
   that Param: the completion store supplies every completion, no fleet is launched.
3. While each run goes, every report page (runs list, Fleet, Data quality) and the metrics endpoint are
   fetched every `--poll-s` seconds; after it, once more.

Reported per size: each stage's wall time (the sum and the longest of its task instances) and the tree's peak
RSS while it ran, the disk the output root keeps (hard links once), the scheduler's time to queue the mapped
tasks, the longest wait between a shard's generate ending and its tokenize starting, the pages' response
times during and after, the rerun's plan_shards (planning + store lookup) and wall time; and the N / (N/10)
ratios (linear = 10).

    .venv/bin/python bench/seed_size.py [--prompts 100000] [--quick] [--no-dag]
"""

from __future__ import annotations

import json
import os
import random
import secrets
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from benchlib import ROOT, cli_argv, figure, free_port_block, parser, run_measured, run_params, work_dir, write_result

sys.path.insert(0, str(ROOT / "tests"))

SERVERS = 7
SHARD = 1000
# Zero latency and short answers (~40 tokens): the CPU of the pipeline is what is measured.
PROFILE = {"decode_tokens_per_s": 1e7, "prefill_tokens_per_s": 1e9, "startup_s": 0.1, "mean_output_tokens": 40,
           "min_reasoning_tokens": 8, "max_output_tokens": 200}
LOOP_SHARE = 0.01  # looped answers (finish_reason length): the first run's gate fails on them
PAGES = {"runs list": "/dflash/", "fleet": "/dflash/runs/{run}/fleet", "quality": "/dflash/runs/{run}/quality",
         "metrics": "/dflash-metrics/metrics"}

SINGLE = ["Write a Python function that {x}.", "Explain why {x}.", "Solve step by step: {x}.",
          "Summarise the following note in three bullet points: {x}", "Translate into French: {x}"]
TOPICS = ["merges two sorted lists", "the sky is blue", "3x + 7 = 22", "a binary heap keeps its shape",
          "a train leaves at 9:40 and arrives at 13:05", "the meeting moved to Thursday because of the storm",
          "reverses a linked list", "TCP needs a three-way handshake"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "search_docs", "description": "Search the documentation.",
          "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                         "required": ["query"]}}}]


def seed_mix_row(i: int, rng: random.Random) -> dict:
    """One prompt row in the seed's proportions: ~60% single-turn, ~25% multi-turn, ~10% tools, ~4.5% bad."""
    topic = f"{rng.choice(TOPICS)} (case {i})"
    kind = rng.random()
    if kind < 0.015 and i:  # a duplicate id
        return {"id": f"seed-{i - 1:07d}", "messages": [{"role": "user", "content": topic}]}
    if kind < 0.03:  # a role no template knows
        return {"id": f"seed-{i:07d}", "messages": [{"role": "narrator", "content": topic}]}
    if kind < 0.045:  # no turns at all
        return {"id": f"seed-{i:07d}", "messages": []}
    if kind < 0.645:
        return {"id": f"seed-{i:07d}", "messages": [{"role": "user", "content": rng.choice(SINGLE).format(x=topic)}]}
    if kind < 0.895:
        turns = []
        for t in range(rng.randint(1, 3)):
            turns += [{"role": "user", "content": f"Part {t}: {rng.choice(SINGLE).format(x=topic)}"},
                      {"role": "assistant", "content": f"Here is part {t}: " + " ".join(rng.choices(TOPICS, k=3))}]
        turns.append({"role": "user", "content": "And now the last part, briefly."})
        return {"id": f"seed-{i:07d}", "system": "You are a careful assistant.", "messages": turns}
    call = {"id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": rng.choice(["Lisbon", "Oslo"])})}}
    return {"id": f"seed-{i:07d}", "tools": TOOLS,
            "messages": [{"role": "user", "content": f"What's the weather, and then {topic}?"},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": f"call_{i}", "content": '{"temp_c": 14, "sky": "rain"}'},
                         {"role": "user", "content": "Thanks. Anything else I should know?"}]}


def write_seed_prompts(path: Path, n: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(n)
    with path.open("w") as f:
        for i in range(n):
            row = seed_mix_row(i, rng)
            if "system" in row:
                row["messages"] = [{"role": "system", "content": row.pop("system")}, *row["messages"]]
            f.write(json.dumps(row) + "\n")
    return path


def tree_rss_mb(pid: int) -> float:
    from live_airflow import descendants

    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def disk(root: Path) -> dict:
    """Bytes per top-level folder of the output root (and of each run folder), a hard link counted once overall."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, int] = {}
    tops = [*(sorted((root / "runs").glob("*/*")) if (root / "runs").is_dir() else []),
            *(p for p in sorted(root.glob("*")) if p.name != "runs")]
    for top in tops:  # runs' folders first: a published file linked to a run's counts for the run
        size = 0
        for dirpath, _, files in os.walk(top) if top.is_dir() else [(str(top.parent), [], [top.name])]:
            for name in files:
                st = os.lstat(os.path.join(dirpath, name))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    size += st.st_blocks * 512
        key = top.relative_to(root).as_posix()
        key = key.split("/", 1)[0] + "/*/" + key.rsplit("/", 1)[1] if key.startswith("runs/") else key
        out[key] = out.get(key, 0) + size
    return out


class Poller(threading.Thread):
    """Fetches each page every `every_s` seconds; keeps the response times (and the Airflow tree's RSS)."""

    def __init__(self, af, run_id: str, every_s: float, pid: int):
        super().__init__(daemon=True)
        self.af, self.run_id, self.every_s, self.pid = af, run_id, every_s, pid
        self.times: dict[str, list[float]] = {k: [] for k in PAGES}
        self.rss: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def fetch_all(self) -> dict[str, float]:
        import requests

        got = {}
        for name, path in PAGES.items():
            bearer = self.af.env["DFLASH_METRICS_TOKEN"] if name == "metrics" else self.af.token()
            headers = {"Authorization": f"Bearer {bearer}"}
            t = time.perf_counter()
            r = requests.get(self.af.url + path.format(run=self.run_id), headers=headers, timeout=300)
            got[name] = round(time.perf_counter() - t, 3) if r.status_code == 200 else -r.status_code
        return got

    def run(self) -> None:
        last = 0.0
        while not self.stop.wait(1.0):
            self.rss.append((time.time(), tree_rss_mb(self.pid)))
            if time.monotonic() - last >= self.every_s:
                last = time.monotonic()
                try:
                    for k, v in self.fetch_all().items():
                        self.times[k].append(v)
                except Exception as exc:  # noqa: BLE001 - a page down during the run is recorded, not fatal
                    print(f"poll failed: {exc}", flush=True)


def parse_ts(s: str | None) -> float | None:
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp() if s else None


def stages(tis: list[dict], rss: list[tuple[float, float]]) -> dict:
    out: dict[str, dict] = {}
    for ti in tis:
        start, end = parse_ts(ti.get("start_date")), parse_ts(ti.get("end_date"))
        if start is None or end is None:
            continue
        s = out.setdefault(ti["task_id"], {"instances": 0, "sum_s": 0.0, "max_s": 0.0, "first": start, "last": end,
                                           "states": {}})
        s["instances"] += 1
        s["sum_s"] += end - start
        s["max_s"] = max(s["max_s"], end - start)
        s["first"], s["last"] = min(s["first"], start), max(s["last"], end)
        s["states"][ti["state"]] = s["states"].get(ti["state"], 0) + 1
    for s in out.values():
        s["span_s"] = round(s["last"] - s["first"], 2)
        s["peak_tree_rss_mb"] = round(max((m for t, m in rss if s["first"] - 1 <= t <= s["last"] + 1), default=0), 1)
        s["sum_s"], s["max_s"] = round(s["sum_s"], 2), round(s["max_s"], 2)
    return out


def scheduling(tis: list[dict]) -> dict:
    """Time from plan_shards' end to the mapped generate tasks' queueing, and the generate -> tokenize waits."""
    plan_end = next(parse_ts(t["end_date"]) for t in tis if t["task_id"] == "plan_shards")
    gen = {t["map_index"]: t for t in tis if t["task_id"] == "generate"}
    tok = {t["map_index"]: t for t in tis if t["task_id"] == "tokenize"}
    queued = sorted(q for t in gen.values() if (q := parse_ts(t.get("queued_when"))))
    waits = [parse_ts(tok[i]["start_date"]) - parse_ts(g["end_date"]) for i, g in gen.items()
             if i in tok and g.get("end_date") and tok[i].get("start_date") and g["state"] == "success"]
    return {"mapped": len(gen), "first_queued_after_plan_s": round(queued[0] - plan_end, 2) if queued else None,
            "last_queued_after_plan_s": round(queued[-1] - plan_end, 2) if queued else None,
            "max_generate_to_tokenize_s": round(max(waits), 2) if waits else None,
            "mean_generate_to_tokenize_s": round(sum(waits) / len(waits), 2) if waits else None}


def page_summary(times: dict[str, list[float]]) -> dict:
    """The first fetch of each page apart: it pays the api-server's first import of the page's code."""
    return {k: {"first_s": v[0] if v else None, "max_s": max(v[1:], default=None),
                "median_s": sorted(v[1:])[len(v[1:]) // 2] if v[1:] else None, "n": len(v)}
            for k, v in times.items()}


def dag_runs(work: Path, prompts: Path, n: int, poll_s: float, rerun: bool = True) -> dict:
    from live_airflow import LiveAirflow

    out = work / "out"
    home = work / "airflow"
    port = free_port_block(3)
    token = secrets.token_hex(8)
    af = LiveAirflow(home, port, {"DFLASH_OUTPUT_ROOT": str(out), "DFLASH_METRICS_TOKEN": token,
                                  "AIRFLOW__CORE__MAX_MAP_LENGTH": "2048"})
    af.env["DFLASH_METRICS_TOKEN"] = token
    params = run_params(work, SERVERS, PROFILE, prompt_source=str(prompts), shard_size=SHARD, budget="train_length",
                        max_tokens=256, autotune="off", calibration_prompts=0, max_bad_row_share=0.06,
                        emulator_faults={"*": {"loop_rate": LOOP_SHARE}}, max_truncated_share=LOOP_SHARE / 4,
                        max_bad_sample_share=0.05, max_repetition_score=1.0, checkpoint_every=250)
    result: dict = {}
    template = os.environ.get("DFLASH_BENCH_AIRFLOW_DB")  # a migrated DB to copy (tests/conftest.py's)
    af.start(timeout_s=600, db=Path(template) if template else None)
    try:
        runs = [("first", params), ("rerun", {**params, "max_truncated_share": 0.05})]
        for label, conf in runs if rerun else runs[:1]:
            run_id = f"seed_{label}_{n}"
            poller = Poller(af, run_id, poll_s, af.procs["scheduler"].pid)
            t = time.monotonic()
            af.trigger(run_id, conf)
            poller.start()
            state = af.wait_run(run_id, timeout_s=6 * 3600)
            wall = time.monotonic() - t
            poller.stop.set()
            poller.join()
            af.wait_settled(run_id, timeout_s=600)
            after = poller.fetch_all()
            tis: list[dict] = []
            while True:  # every task instance: the API answers at most 100 a page, whatever the limit asked
                page = af.api("GET", f"/api/v2/dags/dflash_regen/dagRuns/{run_id}/taskInstances",
                              params={"limit": 100, "offset": len(tis)}).json()
                tis += page["task_instances"]
                if not page["task_instances"] or len(tis) >= page["total_entries"]:
                    break
            result[label] = {"state": state, "wall_s": round(wall, 1), "stages": stages(tis, poller.rss),
                             "scheduling": scheduling(tis) if label == "first" else None,
                             "pages_during": page_summary(poller.times), "pages_after": after,
                             "disk_bytes": disk(out)}
            print(json.dumps({label: result[label]}, indent=1), flush=True)
    finally:
        af.stop()
    return result


def one_size(n: int, poll_s: float, with_dag: bool, rerun: bool = True) -> dict:
    work = work_dir(f"seed-{n}")
    t = time.monotonic()
    prompts = write_seed_prompts(work / "prompts" / "seed.jsonl", n)
    got = {"prompts": n, "write_prompts_s": round(time.monotonic() - t, 1)}
    params = run_params(work, SERVERS, PROFILE, shard_size=SHARD, budget="train_length", max_tokens=256,
                        max_bad_row_share=0.06, output_root=str(work / "plan-only"))
    argv = cli_argv("plan", params, f"plan_{n}", str(prompts), folder=work)
    got["planning"] = run_measured(argv, work / "plan.log")
    if with_dag:
        got["dag"] = dag_runs(work, prompts, n, poll_s, rerun)
    return got


def ratio(big: float | None, small: float | None) -> float | None:
    return big / small if big and small else None


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--prompts", type=int, default=100_000)
    ap.add_argument("--poll-s", type=float, default=20.0)
    ap.add_argument("--no-dag", action="store_true", help="the pieces only (planning), not the DAG")
    args = ap.parse_args()
    n = 1_000 if args.quick else args.prompts
    # --quick (the suite's smoke test): no rerun at N/10, which no figure uses (one whole DAG run less)
    sizes = {"small": one_size(n // 10, args.poll_s, not args.no_dag, rerun=not args.quick)}
    (args.out / "seed_size.partial.json").parent.mkdir(parents=True, exist_ok=True)
    (args.out / "seed_size.partial.json").write_text(json.dumps(sizes, indent=1))
    sizes["large"] = one_size(n, args.poll_s, not args.no_dag)
    small, large = sizes["small"], sizes["large"]
    figures = [figure(10, f"Planning with the real template count, {n:,} vs {n // 10:,} prompts",
                      ratio(large["planning"]["wall_s"], small["planning"]["wall_s"]), "wall at N / wall at N/10",
                      "10 (linear)", wall_s=large["planning"]["wall_s"], small_wall_s=small["planning"]["wall_s"],
                      peak_rss_mb=large["planning"]["peak_rss_mb"])]
    if not args.no_dag:
        lf, sf = large["dag"]["first"], small["dag"]["first"]
        lr = large["dag"]["rerun"]
        figures.append(figure(11, f"Whole DAG under a scheduler, {n:,} vs {n // 10:,} prompts (first run, to the "
                                  "failed validate)", ratio(lf["wall_s"], sf["wall_s"]), "wall at N / wall at N/10",
                              "10 (linear)", wall_s=lf["wall_s"], small_wall_s=sf["wall_s"]))
        figures.append(figure(12, "Rerun after a failed gate / first run", lr["wall_s"] / lf["wall_s"],
                              "rerun wall / first wall at N", "small", rerun_s=lr["wall_s"], first_s=lf["wall_s"]))
    write_result(args.out, "seed_size", figures, sizes)


if __name__ == "__main__":
    main()
