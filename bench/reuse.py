"""Reuse (figure 9): the demo rerun with only a gate Param changed vs the demo run, side by side in one run.

Two runs of the whole DAG by `dag.test()` on one output root, with the demo's Params (scripts/demo.sh: 7
emulated servers, the demo prompts in shards of 20, autotune advise at 3 s a candidate, calibration on):
1. the demo run: plans, stages, launches and gates the fleet, autotunes, calibrates, generates, tokenizes,
   validates and publishes;
2. the same Params but `max_bad_sample_share` (a gate Param): the completion store holds every completion, so
   the fleet setups and teardown skip; planning, tokenize, validate and publish run.
Ratio = rerun wall / demo run wall (want <= 0.2). Raw: both walls, the rerun's reused and generated samples,
and the bytes the store and the rerun's completions add on disk (hard links: 0 of their own). This process gets
its own AIRFLOW_HOME as `airflow_overhead.py` does. `--quick`: 2 servers, no autotune or calibration.

    .venv/bin/python bench/reuse.py [--quick]
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from airflow_overhead import own_airflow_home
from benchlib import ROOT, figure, parser, run_params, work_dir, write_result

DEMO = {"shard_size": 20, "emulator_profile": {"decode_tokens_per_s": 3000, "saturation_tokens_per_s": 24000},
        "autotune": "advise", "autotune_candidate_s": 3}
QUICK = {"shard_size": 60, "emulator_profile": {"decode_tokens_per_s": 20000, "startup_s": 0.1}, "autotune": "off",
         "calibration_prompts": 0}


def timed_run(dag, params: dict) -> tuple[float, object]:
    started = time.perf_counter()
    run = dag.test(run_conf=params)
    wall = time.perf_counter() - started
    if run.state != "success":
        raise RuntimeError(f"dag.test ended {run.state}: {[(t.task_id, t.state) for t in run.get_task_instances()]}")
    return round(wall, 2), run


def own_bytes(paths: list[Path]) -> int:
    """Bytes only these paths hold: files with no other hard link."""
    return sum(p.stat().st_size for p in paths if p.stat().st_nlink == 1)


def main() -> None:
    args = parser(__doc__).parse_args()
    own_airflow_home()
    from airflow.dag_processing.dagbag import DagBag

    from dflash_regen.generate import store
    from dflash_regen.layout import COMPLETIONS, RunLayout
    from dflash_regen.settings.run_config import safe_run_id

    dag = DagBag(dag_folder=str(ROOT / "dags")).dags["dflash_regen"]
    work = work_dir("reuse")
    servers, demo = (2, QUICK) if args.quick else (7, DEMO)
    params = run_params(work, servers, demo["emulator_profile"], **demo)
    first_s, first = timed_run(dag, params)
    rerun_params = {**params, "max_bad_sample_share": params["max_bad_sample_share"] + 0.01,
                    "dataset_name": params["dataset_name"] + "-rerun"}
    rerun_s, rerun = timed_run(dag, rerun_params)
    root = Path(params["output_root"])
    layout = RunLayout.of(root, safe_run_id(rerun.run_id))
    reuse = json.loads(layout.report("plan").read_text())["reuse"]
    skipped = sorted({ti.task_id for ti in rerun.get_task_instances() if ti.state == "skipped"})
    listed = store.listing(root)
    rerun_files = layout.merged_files(COMPLETIONS)
    figures = [figure(9, "Rerun with a changed gate Param / the demo run (whole DAG, dag.test)",
                      rerun_s / first_s, "rerun wall / first run wall (same Params but max_bad_sample_share)",
                      "<= 0.2", first_s=first_s, rerun_s=rerun_s, servers=servers, reused=reuse["reused"],
                      generated=reuse["to_generate"],
                      store_bytes=sum(e["bytes"] for e in listed), store_own_bytes=sum(e["own_bytes"] for e in listed),
                      rerun_completion_bytes=sum(p.stat().st_size for p in rerun_files),
                      rerun_completion_own_bytes=own_bytes(rerun_files))]
    write_result(args.out, "reuse", figures, {"skipped_in_rerun": skipped, "first_run": first.run_id,
                                             "rerun": rerun.run_id, "quick": args.quick})


if __name__ == "__main__":
    main()
