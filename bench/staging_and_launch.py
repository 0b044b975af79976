"""Staging and fleet start (figure 6).

- Staging: `staging.stage` (chunked copy to a temporary name, fsync, rename, SHA-256 of every file against
  the model's SHA256SUMS) against `cp -r` of the very same files, both into a private directory on the RAM
  disk (/dev/shm, where production stages). Also `stage` of the same files without a SHA256SUMS (hard
  links), which separates the hashing cost from the copy. Each is run --repeats times, alternating; the
  best run of each counts (the least disturbed by other load).
- Fleet start: `fleet.servers.launch_fleet` of seven emulated servers against one server (pre-flight, start, wait
  until every /health answers), alternating, best of --repeats.

    .venv/bin/python bench/staging_and_launch.py [--files 4] [--file-mb 256] [--repeats 2] [--quick]
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from benchlib import emulated_fleet, figure, parser, work_dir, write_result

from dflash_regen.demo.model import CONFIG
from dflash_regen.fleet import staging


def make_model(folder: Path, files: int, file_mb: int) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    sums = []
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        data = os.urandom(file_mb * 1024 * 1024)
        (folder / name).write_bytes(data)
        sums.append(f"{hashlib.sha256(data).hexdigest()}  {name}")
    (folder / staging.MANIFEST).write_text("\n".join(sums) + "\n")
    return folder


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def bench_staging(work: Path, files: int, file_mb: int, repeats: int) -> dict:
    source = make_model(work / "model", files, file_mb)
    unsummed = work / "model-no-sums"  # the same files (hard links), no SHA256SUMS
    unsummed.mkdir()
    for path in source.iterdir():
        if path.name != staging.MANIFEST:
            os.link(path, unsummed / path.name)
    total = sum(p.stat().st_size for p in source.iterdir())
    shm = Path(tempfile.mkdtemp(prefix="dflash-bench-stage-", dir="/dev/shm"))
    best: dict[str, float] = {}
    try:
        for _ in range(repeats):
            for name, src, copy in (
                    ("cp", source, lambda s, d: subprocess.run(["cp", "-r", str(s), str(d)], check=True)),
                    ("stage", source, staging.stage), ("stage_no_sums", unsummed, staging.stage)):
                dest = shm / name
                seconds = timed(lambda copy=copy, src=src, dest=dest: copy(src, dest))
                best[name] = min(best.get(name, seconds), seconds)
                shutil.rmtree(dest)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return {"bytes": total, "files": files + 2, **{f"{k}_s": round(v, 3) for k, v in best.items()},
            **{f"{k}_mb_per_s": round(total / 1e6 / v, 1) for k, v in best.items()}}


def bench_launch(work: Path, repeats: int) -> dict:
    best: dict[int, float] = {}
    for r in range(repeats):
        for servers in (1, 7):
            started = time.perf_counter()
            with emulated_fleet(work / f"launch-{servers}-{r}", servers, {}):
                seconds = time.perf_counter() - started  # launched and every server ready
            best[servers] = min(best.get(servers, seconds), seconds)
    return {"one_server_s": round(best[1], 2), "seven_servers_s": round(best[7], 2)}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--file-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if args.quick:
        args.files, args.file_mb, args.repeats = 2, 8, 1
    work = work_dir("stage")
    stage = bench_staging(work, args.files, args.file_mb, args.repeats)
    launch = bench_launch(work, args.repeats)
    figures = [
        figure(6, "Staging: stage_weights MB/s (SHA-256 verified)", stage["stage_mb_per_s"] / stage["cp_mb_per_s"],
               "stage / cp -r (same files, RAM disk)", "~1", stage_mb_per_s=stage["stage_mb_per_s"],
               cp_mb_per_s=stage["cp_mb_per_s"], stage_no_sums_mb_per_s=stage["stage_no_sums_mb_per_s"],
               mb=round(stage["bytes"] / 1e6)),
        figure(6, "Fleet start: time to ready, 7 servers / 1", launch["seven_servers_s"] / launch["one_server_s"],
               "seven servers' launch_fleet s / one server's", "~1 (parallel)", **launch),
    ]
    write_result(args.out, "staging_and_launch", figures, {"staging": stage, "launch": launch,
                                                           "emulator_startup_s": 0.3})


if __name__ == "__main__":
    main()
