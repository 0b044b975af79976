"""The deployment rehearsal's fixture. Only `make test-deploy` (scripts/test-deploy.sh) runs this folder: it starts
the daemon, builds the stand-in images and exports DFLASH_REHEARSAL_*; tests/conftest.py leaves the folder out of
every other pytest run."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from stack import COMPOSE, MODEL_NAME, STATE, Stack, free_loopback_address, v1_copy


@pytest.fixture(scope="session")
def stack() -> Stack:
    if "DOCKER_HOST" not in os.environ or not shutil.which("docker-compose"):
        pytest.skip("the rehearsal runs under scripts/test-deploy.sh (make test-deploy), which starts its dockerd")
    work = STATE / "run"
    if work.exists():  # the last rehearsal's host folders (its containers and volumes went with it)
        subprocess.run(["rm", "-rf", str(work)], check=True)
    s = Stack(work)
    for folder in (s.data, s.models, s.venv):
        folder.mkdir(parents=True)
    s.address = free_loopback_address(8080)
    s.compose_file.write_text(v1_copy(COMPOSE.read_text()))
    # scripts/test-deploy.sh's EXIT trap takes the stack down with these arguments, whatever happens here
    (STATE / "compose.args").write_text(" ".join(s.args()))
    yield s
    s.compose("--profile", "monitoring", "--profile", "second-node", "down", "--volumes", "--remove-orphans",
              check=False)
    for staged in (MODEL_NAME, f"{MODEL_NAME}-node-2"):  # both nodes stage to this host's /dev/shm
        shutil.rmtree(f"/dev/shm/{staged}", ignore_errors=True)
