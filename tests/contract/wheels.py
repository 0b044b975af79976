"""SGLang's wheel per version (downloaded once, cached) and a judge process running SGLang's own code."""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dflash_regen.sglang.api import NEWEST_CHECKED, OLDEST

VERSIONS = [OLDEST, NEWEST_CHECKED]
CACHE = Path.home() / ".cache" / "dflash-regen" / "sglang"
JUDGE = Path(__file__).with_name("judge.py")


def unpacked_wheel(version: str) -> Path:
    """`pip download sglang==V --no-deps`, unpacked (Python files only) under ~/.cache/dflash-regen/sglang/V.

    Under a file lock and renamed into place, so parallel test workers neither race nor see half a tree."""
    root = CACHE / version
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if root.is_dir():
            return root
        wheels = CACHE / "wheels"
        found = sorted(wheels.glob(f"sglang-{version}-*.whl"))
        if not found:
            # pip itself: the project venv is built by uv without pip; the interpreter it was made from has
            # pip (setup.sh installs uv with it). PATH's python3 is the venv's own, so it is not asked.
            python = _python_with_pip()
            subprocess.run([python, "-m", "pip", "download", f"sglang=={version}", "--no-deps",
                            "--only-binary=:all:", "-q", "-d", str(wheels)], check=True, timeout=600)
            found = sorted(wheels.glob(f"sglang-{version}-*.whl"))
        tmp = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=CACHE))
        with zipfile.ZipFile(found[0]) as wheel:
            wheel.extractall(tmp, [m for m in wheel.namelist() if m.startswith("sglang/") and m.endswith(".py")])
        tmp.rename(root)
    return root


def _python_with_pip() -> str:
    base = Path(sys.base_prefix) / "bin" / "python3"
    for python in (sys.executable, str(base), shutil.which("python3") or ""):
        if python and subprocess.run([python, "-m", "pip", "--version"], capture_output=True,
                                     check=False).returncode == 0:
            return python
    raise RuntimeError("no Python with pip found to download SGLang's wheel; install pip for "
                       f"{base} or put the wheels in {CACHE / 'wheels'}")


class Judge:
    """SGLang `version`'s own parser, protocol models and output parsers, in a subprocess."""

    def __init__(self, version: str):
        self.version = version
        self.proc = subprocess.Popen([sys.executable, str(JUDGE), str(unpacked_wheel(version))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)

    def ask(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"SGLang {self.version}'s judge died; run tests/contract/judge.py by hand to see why"
        answer = json.loads(line)
        assert "error" not in answer or op == "validate", answer
        return answer

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
