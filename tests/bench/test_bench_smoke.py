"""`bench/run.py --quick` runs every benchmark at tiny sizes and reports every figure, so the benchmarks
cannot rot. The figures themselves are not checked: timings belong to `make bench`, never to tests."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_bench_reports_every_figure_with_raw_numbers_and_a_ratio(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "latest.json").read_text())
    assert report["quick"] and report["machine"]["cores"] >= 1
    figures = report["figures"]
    assert {f["figure"] for f in figures} == set(range(1, 9))
    for f in figures:
        assert f["name"] and f["ratio_of"] and f["ideal"] and "ratio" in f, f
        assert any(isinstance(v, int | float) for v in f["raw"].values()), f
    for number in range(1, 9):  # each figure has at least one measured ratio
        assert any(isinstance(f["ratio"], float | int) for f in figures if f["figure"] == number), number
    table = (tmp_path / "latest.md").read_text()
    assert table.count("\n| ") == len(figures) + 1  # header + one row per figure
