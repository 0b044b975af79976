"""Run every benchmark in bench/ and write bench/results/latest.json and latest.md (docs/benchmarks.md's table).

Each benchmark runs in its own process, one after another (they would disturb each other's timings), and
writes its own JSON; this collects their figures. A benchmark that fails is recorded with its error and
the others still run; the exit status is then 1.

    .venv/bin/python bench/run.py [--quick] [--out bench/results] [--only resume ...]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from benchlib import BENCH, machine, parser

# In figure order.
BENCHMARKS = ["fleet_utilisation", "process_cost", "airflow_overhead", "tokenize_and_validate",
              "staging_and_launch", "resume", "autotune_budget", "reuse", "seed_size"]


def raw_text(raw: dict) -> str:
    return ", ".join(f"{k} {v:,}" if isinstance(v, int | float) else f"{k} {v}" for k, v in raw.items())


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"Machine: {m['arch']}, {m['cores']} cores, {m['ram_gb']} GB RAM, Python {m['python']}, "
             f"{m['date']}{' (--quick: sizes too small for the figures to mean anything)' if report['quick'] else ''}",
             "", "| # | figure | ratio | of | ideal | raw numbers |", "|---|---|---|---|---|---|"]
    for f in sorted(report["figures"], key=lambda f: f["figure"]):
        ratio = "n/a" if f["ratio"] is None else f"{f['ratio']:.3g}"
        lines.append(f"| {f['figure']} | {f['name']} | **{ratio}** | {f['ratio_of']} | {f['ideal']} | "
                     f"{raw_text(f['raw'])} |")
    for name, b in report["benchmarks"].items():
        if b.get("error"):
            lines.append(f"\n**{name} failed**: {b['error']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--only", nargs="+", choices=BENCHMARKS, default=BENCHMARKS)
    args = ap.parse_args()
    parts = args.out / "parts"
    report = {"machine": machine(), "quick": args.quick, "benchmarks": {}, "figures": []}
    started = time.monotonic()
    for name in args.only:
        argv = [sys.executable, str(BENCH / f"{name}.py"), "--out", str(parts)] + (["--quick"] if args.quick else [])
        print(f"== {name}", flush=True)
        t = time.monotonic()
        log = parts / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f:
            done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, check=False)
        entry = {"seconds": round(time.monotonic() - t, 1), "log": str(log)}
        if done.returncode == 0:
            result = json.loads((parts / f"{name}.json").read_text())
            entry["details"] = result["details"]
            report["figures"] += result["figures"]
        else:
            entry["error"] = f"exit {done.returncode}; last lines of {log}:\n" + \
                "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        report["benchmarks"][name] = entry
        print(f"   {entry['seconds']} s" + (" FAILED" if "error" in entry else ""), flush=True)
    report["seconds"] = round(time.monotonic() - started, 1)
    (args.out / "latest.json").write_text(json.dumps(report, indent=1))
    (args.out / "latest.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {args.out / 'latest.json'} and latest.md in {report['seconds']} s")
    sys.exit(1 if any("error" in b for b in report["benchmarks"].values()) else 0)


if __name__ == "__main__":
    main()
