"""SGLang's venv for the GPU node is locked: sglang-V.lock in deploy/sglang-locks/, one per version the docs name.

- each lock is current: scripts/lock-sglang-venv.sh --check resolves it again from its header's inputs (the
  requirement, platform, Python and cut-off date) and gets the same pins; a changed pin is caught; the refresh
  (make sglang-locks), given a lock's cut-off date, writes that lock again byte for byte;
- each names the glibc the node needs, and needs it: one minor release below, the same pins do not resolve;
- each installs on a real Linux x86_64 with glibc >= its floor and Python 3.11 (this machine), wheels only
  (`uv pip sync --dry-run`: the index answers for every pin; nothing is downloaded);
- scripts/build-sglang-venv.sh (the real script) syncs exactly the asked version's lock, and refuses a version
  without a lock and an older glibc before it installs anything.

Resolving takes 6-22 s per lock (246 and 248 packages; uv's metadata requests, cold cache as fast), so these
run with the rest of the suite. They need the package index, as the contract tests do.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_regen.sglang.api import NEWEST_CHECKED, RECOMMENDED

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "deploy" / "sglang-locks"
LOCK_SCRIPT = ROOT / "scripts" / "lock-sglang-venv.sh"
BUILD_SCRIPT = ROOT / "scripts" / "build-sglang-venv.sh"
VERSIONS = sorted(p.name[len("sglang-"):-len(".lock")] for p in LOCKS.glob("sglang-*.lock"))
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$", re.M)
# URLs, host names and index options: a lock names packages and versions, never where they come from.
NO_SOURCES = re.compile(r"://|\b[\w-]+\.(?:org|com|io|ai|net|dev)\b"
                        r"|^\s*-[-\w]*(?:index|find-links|trusted-host)|^\s*-[if]\s", re.I | re.M)


def header(lock: Path) -> dict[str, str]:
    return dict(re.findall(r"^# ([\w-]+): (.*)$", lock.read_text(), re.M))


def pins(text: str) -> dict[str, str]:
    return dict(PIN.findall(text))


def uv() -> str:
    found = shutil.which("uv")
    if not found:
        pytest.fail("uv is not on PATH: scripts/setup.sh installs it (uv==0.13.8)")
    return found


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, **(env or {})})


def test_a_lock_for_the_recommended_and_the_newest_supported_version():
    assert RECOMMENDED in VERSIONS and NEWEST_CHECKED in VERSIONS, VERSIONS
    default = re.search(r'SGLANG_VERSION="\$\{SGLANG_VERSION:-([\d.]+)\}"', BUILD_SCRIPT.read_text())
    assert default and default[1] in VERSIONS


@pytest.mark.parametrize("version", VERSIONS)
def test_the_lock_names_its_inputs_and_no_registry(version):
    lock = LOCKS / f"sglang-{version}.lock"
    text, head = lock.read_text(), header(lock)
    assert head["requirement"] == f"sglang[all]=={version}"
    assert re.fullmatch(r"\d+\.\d+", head["glibc"]) and head["python"] == "3.11"
    assert head["platform"] == f"x86_64-manylinux_{head['glibc'].replace('.', '_')}"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", head["exclude-newer"])
    found = pins(text)
    assert found["sglang"] == version and int(head["packages"]) == len(found) > 200
    assert not NO_SOURCES.findall(text.replace("--no-emit-index-url", ""))


@pytest.mark.parametrize("version", VERSIONS)
def test_the_lock_is_what_its_inputs_resolve_to(version):
    result = run(["bash", str(LOCK_SCRIPT), "--check", version])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"sglang {version}: " in result.stdout and "is current" in result.stdout


def test_a_changed_pin_is_caught(tmp_path):
    """The check compares: a copy of the default lock with torch's pin changed fails, naming both pins."""
    copy = tmp_path / "locks"
    copy.mkdir()
    text = (LOCKS / f"sglang-{RECOMMENDED}.lock").read_text()
    torch = pins(text)["torch"]
    (copy / f"sglang-{RECOMMENDED}.lock").write_text(text.replace(f"\ntorch=={torch}\n", "\ntorch==2.0.0\n"))
    result = run(["bash", str(LOCK_SCRIPT), "--check", RECOMMENDED], env={"SGLANG_LOCKS_DIR": str(copy)})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "< torch==2.0.0" in result.stderr and f"> torch=={torch}" in result.stderr
    assert "refresh it" in result.stderr


def test_the_refresh_writes_the_lock_again(tmp_path):
    """make sglang-locks' script, given the newest lock's own cut-off date, writes that lock byte for byte."""
    lock = LOCKS / f"sglang-{NEWEST_CHECKED}.lock"
    result = run(["bash", str(LOCK_SCRIPT), NEWEST_CHECKED],
                 env={"SGLANG_LOCKS_DIR": str(tmp_path), "EXCLUDE_NEWER": header(lock)["exclude-newer"]})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / lock.name).read_text() == lock.read_text()
    assert [p.name for p in tmp_path.iterdir()] == [lock.name]  # no temporary file left


@pytest.mark.parametrize("version", VERSIONS)
def test_the_lock_needs_the_glibc_it_names(version):
    """One glibc minor release below the header's, the lock's pins do not resolve: the floor is not overstated
    (and the script refuses below it: test_an_older_glibc_is_refused)."""
    lock = LOCKS / f"sglang-{version}.lock"
    head = header(lock)
    major, minor = (int(x) for x in head["glibc"].split("."))
    result = subprocess.run([uv(), "pip", "compile", "--quiet", "--no-header", "--no-annotate", "--python-version",
                             head["python"], "--python-platform", f"x86_64-manylinux_{major}_{minor - 1}",
                             "--exclude-newer", head["exclude-newer"], "--only-binary", ":all:", "-"],
                            input=head["requirement"] + "\n", capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode != 0 or pins(result.stdout) != pins(lock.read_text()), (
        f"the lock's pins resolve on glibc {major}.{minor - 1} too: lower GLIBC in scripts/lock-sglang-venv.sh")


@pytest.mark.skipif(sys.version_info[:2] != (3, 11) or not sys.platform.startswith("linux"),
                    reason="a dry-run install wants Linux and the lock's Python 3.11")
@pytest.mark.parametrize("version", VERSIONS)
def test_the_lock_installs_here_wheels_only(version, tmp_path):
    """This machine is a node's platform (Linux x86_64, glibc 2.36, Python 3.11): every pin has a wheel for it."""
    venv = tmp_path / "venv"
    made = run([uv(), "venv", "--quiet", "--python", sys.executable, str(venv)])
    assert made.returncode == 0, made.stderr
    result = run([uv(), "pip", "sync", "--dry-run", "--strict", "--only-binary", ":all:",
                  str(LOCKS / f"sglang-{version}.lock")], env={"VIRTUAL_ENV": str(venv)})
    assert result.returncode == 0, result.stderr
    assert f"Would install {header(LOCKS / f'sglang-{version}.lock')['packages']} packages" in result.stderr


# ------------------------------------------------------------------------------ scripts/build-sglang-venv.sh
STUB_UV = """#!/bin/sh
echo "$*" >> "$STUB_LOG"
case "$1" in
  --version) echo "uv 0.13.8";;
  venv) for a; do venv=$a; done  # the last argument
        mkdir -p "$venv/bin"; printf '#!/bin/sh\\necho sglang stub\\n' > "$venv/bin/python"
        chmod +x "$venv/bin/python";;
esac
"""


@pytest.fixture
def stub_uv(tmp_path):
    """A `uv` on PATH that logs its arguments: the script runs for real, nothing is installed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "uv").write_text(STUB_UV)
    (bin_dir / "uv").chmod(0o755)
    log = tmp_path / "uv.log"
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_LOG": str(log)}, log


def build(venv: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return run(["bash", str(BUILD_SCRIPT), str(venv)], env=env, timeout=60)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_build_syncs_the_asked_versions_lock(version, tmp_path, stub_uv):
    env, log = stub_uv
    venv = tmp_path / "sglang-venv"
    result = build(venv, {**env, "SGLANG_VERSION": version})  # this machine's own glibc, read by the script
    assert result.returncode == 0, result.stderr
    here = os.confstr("CS_GNU_LIBC_VERSION").split()[1]
    assert f"glibc {here} >= {header(LOCKS / f'sglang-{version}.lock')['glibc']}" in result.stdout
    calls = log.read_text().splitlines()
    lock = LOCKS / f"sglang-{version}.lock"
    assert f"venv --allow-existing --python 3.11 {venv}" in calls  # a rebuild syncs the venv that is there
    assert f"pip sync --strict --only-binary :all: {lock}" in calls
    assert not [c for c in calls if c.startswith(("pip install", "pip compile"))]


def test_a_version_without_a_lock_is_refused(tmp_path, stub_uv):
    env, log = stub_uv
    result = build(tmp_path / "sglang-venv", {**env, "SGLANG_VERSION": "0.5.99", "SGLANG_VENV_GLIBC": "2.36"})
    assert result.returncode == 2
    first = result.stderr.splitlines()[0]
    assert "no lock for SGLang 0.5.99" in first and str(LOCKS) in first
    assert all(v in first for v in VERSIONS) and "scripts/lock-sglang-venv.sh 0.5.99" in first
    assert not log.exists() and not (tmp_path / "sglang-venv").exists()


@pytest.mark.parametrize("found", ["2.33", "2.31", "1.99", ""])
def test_an_older_glibc_is_refused(found, tmp_path, stub_uv):
    env, log = stub_uv
    need = header(LOCKS / f"sglang-{RECOMMENDED}.lock")["glibc"]
    result = build(tmp_path / "sglang-venv", {**env, "SGLANG_VERSION": RECOMMENDED, "SGLANG_VENV_GLIBC": found})
    assert result.returncode == 2
    first = result.stderr.splitlines()[0]
    assert f"glibc {found or 'not found'} here" in first and f"needs glibc >= {need}" in first
    assert f"SGLang {RECOMMENDED}" in first
    assert not log.exists() and not (tmp_path / "sglang-venv").exists()


@pytest.mark.parametrize("found", ["2.34", "2.39", "3.0"])
def test_the_lock_floor_and_newer_glibcs_build(found, tmp_path, stub_uv):
    env, log = stub_uv
    result = build(tmp_path / "sglang-venv", {**env, "SGLANG_VERSION": RECOMMENDED, "SGLANG_VENV_GLIBC": found})
    assert result.returncode == 0, result.stderr
    assert any(c.startswith("pip sync") for c in log.read_text().splitlines())
