"""Airflow overhead (figure 3): wall time of N mapped shards under Airflow minus the work itself.

For N = 1, 10, 100 one-prompt shards on a zero-latency emulated fleet (one server), side by side:
- direct: the task bodies (`tasks.*`: stage, launch, health, smoke, plan, calibrate, N x generate,
  stop) called in the DAG's order in this process: the work itself;
- Airflow: the same DAG run by `dag.test()` (no executor: each task instance runs in this process, one at a
  time, through the Task SDK's task runner and the metadata DB, SQLite), with the same Params. `tokenize`,
  `validate` and `publish` are marked success instead of run (`mark_success_pattern`): their work is not
  in the direct path either, but their N + 2 task instances still pass through Airflow.
Overhead per shard = (Airflow wall - direct wall) / N. This process gets its own AIRFLOW_HOME (a fresh,
migrated SQLite DB) the way tests/conftest.py sets one up; env DFLASH_BENCH_AIRFLOW_DB names an already migrated
DB to copy instead (the bench smoke test passes the test session's).

    .venv/bin/python bench/airflow_overhead.py [--shards 1 10 100] [--quick]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchlib import ROOT, ZERO_LATENCY, figure, parser, run_params, work_dir, write_prompts, write_result

NOT_RUN = "tokenize|validate|publish|check_published"  # the run's verdict needs a published dataset


def own_airflow_home() -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    import conftest  # noqa: F401  sets AIRFLOW_HOME to a fresh temp dir and the rest of the test environment

    home = os.environ["AIRFLOW_HOME"]
    if template := os.environ.get("DFLASH_BENCH_AIRFLOW_DB"):
        shutil.copyfile(template, Path(home) / "airflow.db")
    else:
        airflow = Path(sys.executable).parent / "airflow"
        subprocess.run([str(airflow), "db", "migrate"], capture_output=True, check=True, timeout=600)
    return home


def params_for(work: Path, label: str, shards: int) -> dict:
    source = write_prompts(work / f"prompts-{shards}.jsonl", shards)
    # calibrate needs 32+ prompts and is a once-per-run cost, not a per-shard one: its task runs and skips.
    return run_params(work / label, 1, ZERO_LATENCY, prompt_source=str(source), shard_size=1,
                      calibration_prompts=0)


def direct(params: dict, run_id: str) -> int:
    from dflash_regen import tasks

    staged = tasks.stage_weights(params, run_id)
    fleet = tasks.launch_fleet(params, run_id, staged["model_path"])
    try:
        tasks.health_check(params, run_id, fleet)
        tasks.smoke_test(params, run_id, fleet)
        shards = tasks.plan_shards(params, run_id)
        tasks.calibrate(params, run_id, fleet, shards)
        for shard in shards:
            tasks.generate(params, run_id, shard)
    finally:
        tasks.stop_fleet(fleet)
    return len(shards)


def airflow(dag, params: dict) -> int:
    run = dag.test(run_conf=params, mark_success_pattern=NOT_RUN)
    if run.state != "success":
        raise RuntimeError(f"dag.test ended {run.state}: {[(t.task_id, t.state) for t in run.get_task_instances()]}")
    return sum(1 for ti in run.get_task_instances() if ti.task_id == "generate")


def timed(fn, *args) -> tuple[float, int]:
    started = time.perf_counter()
    count = fn(*args)
    return round(time.perf_counter() - started, 2), count


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 10, 100])
    args = ap.parse_args()
    if args.quick:  # one size: the figure's row (the growth figure needs three sizes, never in --quick)
        args.shards = [1]
    home = own_airflow_home()
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(ROOT / "dags")).dags["dflash_regen"]
    work = work_dir("airflow")
    if not args.quick:  # first calls import and warm up the library and Airflow; neither side should pay that
        direct(params_for(work, "warm-up", 1), "warm-up")
        airflow(dag, params_for(work, "warm-up-airflow", 1))
    rows = []
    for n in args.shards:
        direct_s, direct_n = timed(direct, params_for(work, f"direct-{n}", n), f"direct-{n}")
        airflow_s, airflow_n = timed(airflow, dag, params_for(work, f"airflow-{n}", n))
        assert direct_n == airflow_n == n, (direct_n, airflow_n, n)
        rows.append({"shards": n, "direct_s": direct_s, "airflow_s": airflow_s,
                     "overhead_s": round(airflow_s - direct_s, 2),
                     "overhead_per_shard_s": round((airflow_s - direct_s) / n, 3)})
    figures = [figure(3, f"Airflow overhead, {r['shards']} mapped shard(s)", r["airflow_s"] / r["direct_s"],
                      "dag.test wall / direct task bodies' wall", "~1", **r) for r in rows]
    if len(rows) >= 3:  # how it grows: overhead per extra shard over the last step of N vs the first step
        a, b, c = rows[0], rows[-2], rows[-1]
        early = (b["overhead_s"] - a["overhead_s"]) / (b["shards"] - a["shards"])
        late = (c["overhead_s"] - b["overhead_s"]) / (c["shards"] - b["shards"])
        figures.append(figure(3, f"Airflow overhead growth: s per extra shard, {b['shards']}->{c['shards']} / "
                              f"{a['shards']}->{b['shards']}", late / early if early > 0 else None,
                              "marginal overhead ratio", "~1 (linear in shards)",
                              **{f"per_extra_shard_{a['shards']}_to_{b['shards']}_s": round(early, 3),
                                 f"per_extra_shard_{b['shards']}_to_{c['shards']}_s": round(late, 3)}))
    write_result(args.out, "airflow_overhead", figures, {
        "executor_path": "dag.test() without an executor: task instances run one at a time in this process "
                         "(Task SDK task runner, in-process execution API, SQLite metadata DB)",
        "not_run_but_scheduled": NOT_RUN, "airflow_home": home, "runs": rows})


if __name__ == "__main__":
    main()
