"""`bench/run.py --quick` runs the benchmarks at tiny sizes and reports every figure, so the benchmarks
cannot rot. The figures themselves are not checked: timings belong to `make bench`, never to tests.

Three runs, so the pytest workers share them: `airflow_overhead`, `resume` and `reuse` (figures 3, 7 and 9,
whose cost at --quick sizes is all process starts, fleet launches and whole DAG runs); `seed_size` (figures 10-12:
the whole DAG under a real scheduler, twice per size); and the rest.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APART = {"airflow_overhead": 3, "resume": 7, "reuse": 9}  # benchmark -> its figure: the second run
SEED_SIZE = {"seed_size": (10, 11, 12)}  # the third


def benchmarks() -> list[str]:
    sys.path.insert(0, str(ROOT / "bench"))  # as `bench/run.py` runs: beside benchlib
    from run import BENCHMARKS

    return BENCHMARKS


@pytest.mark.parametrize("group", ["most", "overhead-and-resume", "seed-size"])
def test_quick_bench_reports_every_figure_with_raw_numbers_and_a_ratio(tmp_path, group, airflow_db_template):
    assert APART.keys() < set(benchmarks()) and SEED_SIZE.keys() < set(benchmarks())
    groups = {"overhead-and-resume": set(APART.values()), "seed-size": set(SEED_SIZE["seed_size"])}
    groups["most"] = set(range(1, 13)) - groups["overhead-and-resume"] - groups["seed-size"]
    only = {"overhead-and-resume": list(APART), "seed-size": list(SEED_SIZE),
            "most": [b for b in benchmarks() if b not in APART and b not in SEED_SIZE]}[group]
    env = {**os.environ, "DFLASH_BENCH_AIRFLOW_DB": str(airflow_db_template)}  # not a second `airflow db migrate`
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--out", str(tmp_path),
                           "--only", *only], capture_output=True, text=True, timeout=900, check=False, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "latest.json").read_text())
    assert report["quick"] and report["machine"]["cores"] >= 1
    figures = report["figures"]
    expected = groups[group]
    assert {f["figure"] for f in figures} == expected
    for f in figures:
        assert f["name"] and f["ratio_of"] and f["ideal"] and "ratio" in f, f
        assert any(isinstance(v, int | float) for v in f["raw"].values()), f
    for number in expected:  # each figure has at least one measured ratio
        assert any(isinstance(f["ratio"], float | int) for f in figures if f["figure"] == number), number
    table = (tmp_path / "latest.md").read_text()
    assert table.count("\n| ") == len(figures) + 1  # header + one row per figure
