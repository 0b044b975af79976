"""SpecForge's own data code judging a published `conversations.jsonl`: `tests/contract/specforge_judge.py` run in
a side venv holding `specforge==0.2.0`, a CPU torch and SpecForge's transformers, its ids and masks held against
ours. Shared by the contract test (fixtures: tests/contract/test_specforge_contract.py) and the demo run
(tests/e2e/test_dag_run.py).

The side venv is built once under ~/.cache/dflash-regen/ (tests/side_venv.py); its name carries a hash of
`tests/contract/specforge-requirements.txt`. pip, not uv: the CPU
torch wheel lies on this machine's disk where pip's configuration finds it. `python tests/specforge_check.py`
builds it ahead of the tests (its cost cold and warm: docs/testing.md).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
from contract.wheels import _python_with_pip
from side_venv import built_once

CONTRACT = Path(__file__).with_name("contract")
JUDGE = CONTRACT / "specforge_judge.py"
PATHS = ("parser", "online", "offline")

SPECFORGE = "specforge==0.2.0"
REQUIREMENTS = CONTRACT / "specforge-requirements.txt"


def specforge_python() -> Path:
    """The side venv's interpreter, the venv built first if this requirements file has none yet."""
    digest = hashlib.sha256((SPECFORGE + REQUIREMENTS.read_text()).encode()).hexdigest()[:10]
    root = built_once(f"specforge-venv-{digest}", _build)
    return root / "bin" / "python"


def _build(venv: Path) -> None:
    subprocess.run([_python_with_pip(), "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "-r", str(REQUIREMENTS)], check=True, timeout=1800)
    subprocess.run([*pip, "--no-deps", SPECFORGE], check=True, timeout=600)
    # The judge imports exactly what the tests import; a broken install fails here, not in a test's subprocess.
    subprocess.run([str(venv / "bin" / "python"), "-c", "import specforge.data.preprocessing, specforge.utils"],
                   check=True, timeout=600)


def judged(files: list[Path], model_dir: Path, max_length: int, out: Path) -> list[dict]:
    """SpecForge's verdict on each file (see specforge_judge.py for what each path runs), in one process."""
    done = subprocess.run([str(specforge_python()), str(JUDGE), str(model_dir), str(max_length), str(out),
                           *map(str, files)], capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, f"SpecForge's judge failed on {files}:\n{done.stderr[-3000:]}"
    return json.loads(out.read_text())


def published_tokens(version: Path) -> dict[str, tuple[list[int], list[int]]]:
    """Our ids and masks, by sample id, from a published version's `tokenized/`."""
    rows = [r for p in sorted((version / "tokenized").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    return {r["sample_id"]: (r["input_ids"], r["loss_mask"]) for r in rows}


def assert_specforge_reproduces(verdict: dict, ours: dict[str, tuple[list[int], list[int]]], max_length: int) -> None:
    """Every SpecForge path keeps every row, with our ids and masks (cut at max_length, as SpecForge cuts)."""
    problems = []
    for path in PATHS:
        got = verdict["paths"][path]
        if verdict["dropped"][path] or set(got) != set(ours):
            problems.append(f"{path}: {verdict['dropped'][path]} of {verdict['rows']} rows dropped")
            continue
        ids = [i for i in ours if got[i][0] != ours[i][0][:max_length]]
        masks = [i for i in ours if got[i][1] != ours[i][1][:max_length]]
        if ids or masks:
            problems.append(f"{path}: ids differ on {len(ids)} of {len(ours)} rows ({ids[:3]}), masks on "
                            f"{len(masks)} ({masks[:3]})")
    assert not problems, "SpecForge's own code does not reproduce the published tokens: " + "; ".join(problems)


if __name__ == "__main__":
    print(specforge_python())
