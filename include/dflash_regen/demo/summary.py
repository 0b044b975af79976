"""Print what the demo run did, from the run folder's reports (used by scripts/demo.sh).

python -m dflash_regen.demo.summary <output_root> <the run's Airflow task-log folder> <exit code>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflash_regen.layout import COMPLETIONS, FAILURES, RunLayout, published_manifests, runs_dir


def latest_run(output_root: Path) -> Path | None:
    runs = [p for p in runs_dir(output_root).glob("*") if p.is_dir()]
    return max(runs, key=lambda p: p.stat().st_mtime) if runs else None


def task_failures(log_dir: Path) -> list[str]:
    """'<task>[<map index>] try <n>: <first line of its error>' from Airflow's JSON task logs of one run."""
    found = []
    for path in sorted(log_dir.rglob("attempt=*.log")):
        parts = {k: v for k, _, v in (p.partition("=") for p in path.relative_to(log_dir).with_suffix("").parts)}
        where = parts.get("task_id", "?") + (f"[{parts['map_index']}]" if "map_index" in parts else "")
        for line in path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            for error in entry.get("error_detail") or []:
                first = (str(error.get("exc_value", "")).splitlines() or [""])[0]
                found.append(f"{where} try {parts.get('attempt', '?')}: {error.get('exc_type')}: {first}")
                break
    return found


def _nothing_generated(layout: RunLayout) -> bool:
    plan = layout.report("plan")
    return plan.is_file() and (json.loads(plan.read_text()).get("reuse") or {}).get("to_generate") == 0


def summarize(output_root: Path, log_path: Path, rc: int) -> str:
    lines = []
    run = latest_run(output_root)
    if run is None:
        lines.append(f"no run folder under {runs_dir(output_root)}")
    else:
        lines.append(f"run folder: {run}")
        layout = RunLayout(run)
        for name in ("staging", "health", "smoke", "plan"):
            path = layout.report(name)
            if not path.is_file():
                lines.append(f"  {name:<8} (no report)")
                continue
            report = json.loads(path.read_text())
            if name == "staging":
                lines.append(f"  staging  {report['files']} files, {report['copied_files']} copied, "
                             f"{report['mb_per_s']} MB/s")
            elif name == "plan":
                lines.append(f"  plan     {report['rows']} prompts: {report['accepted']} accepted, "
                             f"{report['quarantined']} quarantined {report['quarantined_by_reason']}, "
                             f"{report['shards']} shards")
                if (report.get("reuse") or {}).get("reused"):
                    lines.append(f"  store    {report['reuse']['reused']} completions reused from earlier runs, "
                                 f"{report['reuse']['to_generate']} left to generate")
            elif "servers" in report:
                verdict = "passed" if report.get("passed") else "FAILED"
                lines.append(f"  {name:<8} {verdict} on {len(report['servers'])} servers")
            else:
                lines.append(f"  {name:<8} FAILED: {report.get('error', '').splitlines()[0]}")
        done = layout.merged_files(COMPLETIONS)
        if done:
            import pyarrow.parquet as pq

            rows = sum(pq.read_metadata(p).num_rows for p in done)
            failed = sum(pq.read_metadata(p).num_rows for p in layout.merged_files(FAILURES))
            lines.append(f"  generate {rows} completions in {len(done)} shards, {failed} rejected by the servers")
        quality = layout.report("quality")
        if quality.is_file():
            q = json.loads(quality.read_text())
            lines.append(f"  quality  {'passed' if q['success'] else 'FAILED'}: {q['kept']} kept, {q['quarantined']} "
                         f"quarantined {q['quarantined_by_reason']}; Data Docs: {q['data_docs']}")
        for manifest in published_manifests(output_root, run.name):
            m = json.loads(manifest.read_text())
            lines.append(f"  publish  {manifest.parent}: {m['counts']['published']} samples, "
                         f"{m['tokens']['total']:,} tokens; {m['counts']['quarantined']} quarantined "
                         f"{m['counts']['quarantined_by_reason']}")
        lines.append(f"  server logs: {layout.fleet_dir}")
    if rc != 0:
        lines.append(f"demo FAILED; task logs: {log_path}")
        lines.extend(f"  {line[:300]}" for line in task_failures(log_path))
    elif run is not None and _nothing_generated(RunLayout(run)):
        lines.append("demo passed: plan (every completion from an earlier run, the completion store) -> tokenize -> "
                     "validate -> publish; no fleet needed (rm -rf the output root, or Param reuse off, to generate "
                     "again)")
    else:
        lines.append("demo passed: stage -> launch -> health -> smoke -> plan -> generate -> tokenize -> validate -> "
                     "publish, fleet stopped")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])))
