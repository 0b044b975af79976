"""Stage model weights to a fast local directory (the RAM disk `/dev/shm` on the GPU node).

Checks free space before copying anything, copies each file to a temporary name and renames it, verifies
sizes (and SHA-256 sums when the source has a `SHA256SUMS` manifest), skips files already staged, and
records a `.staged.json` marker so a second run returns at once. A crash at any moment leaves either a
complete file or a `.partial` one that the next run replaces.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_regen.errors import StagingError
from dflash_regen.payloads import Staged
from dflash_regen.settings.run_config import RunConfig

log = logging.getLogger(__name__)

MANIFEST = "SHA256SUMS"
MARKER = ".staged.json"
PARTIAL = ".partial"
CHUNK = 16 * 1024 * 1024
# Leave room on the RAM disk for the servers' own scratch files; staging to 100% full would break them.
FREE_MARGIN_BYTES = 256 * 1024 * 1024
# Docker makes this file in every container (where /dev/shm is its own 64 MB unless the host's is mounted).
CONTAINER_MARKER = Path("/.dockerenv")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class StageReport:
    staging_dir: str
    files: int
    total_bytes: int
    copied_files: int
    copied_bytes: int
    skipped_files: int
    seconds: float
    verified_checksums: int

    @property
    def mb_per_s(self) -> float:
        return self.copied_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "mb_per_s": round(self.mb_per_s, 1)}


def read_manifest(source: Path) -> dict[str, str]:
    """`sha256sum` output format: '<hex>  <relative path>' per line."""
    path = source / MANIFEST
    if not path.is_file():
        return {}
    sums: dict[str, str] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        digest, _, name = line.partition("  ")
        name = name.lstrip("*")
        if len(digest) != 64 or not name:
            raise StagingError(f"{path}:{lineno}: expected '<sha256 hex>  <file>', got {line!r}; "
                               "regenerate it with `sha256sum * > SHA256SUMS` in the model dir")
        sums[name] = digest.lower()
    return sums


def list_source(source: Path) -> dict[str, int]:
    if not source.is_dir():
        raise StagingError(f"model source {source} is not a directory; set Param model_source_dir to the "
                           "directory that holds config.json and the weight files")
    if not (source / "config.json").is_file():
        raise StagingError(f"model source {source} has no config.json; is this a model directory?")
    files = {}
    for path in sorted(source.rglob("*")):
        if path.is_file() and not path.name.endswith(PARTIAL) and path.name != MARKER:
            files[path.relative_to(source).as_posix()] = path.stat().st_size
    return files


def _space_hint(dest: Path, needed: int) -> str:
    """How to make room. In a container /dev/shm is Docker's own 64 MB unless the host's RAM disk is mounted
    there, which is what docker-compose.yaml does for the GPU workers."""
    if CONTAINER_MARKER.exists() and Path("/dev/shm") in (dest, *dest.parents):
        return ("This container's /dev/shm is not the node's RAM disk: keep docker-compose.yaml's "
                "`- /dev/shm:/dev/shm` volume on the GPU worker (or give the service a `shm_size` above "
                f"{human_bytes(needed + FREE_MARGIN_BYTES)}), or set Param staging_dir to a larger local disk.")
    return "Free space there (e.g. remove old staged models) or set Param staging_dir to a larger local disk."


def _already_staged(dest: Path, rel: str, size: int, digest: str | None) -> bool:
    target = dest / rel
    if not target.is_file() or target.stat().st_size != size:
        return False
    return digest is None or _sha256(target) == digest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _copy_verified(src: Path, target: Path, size: int, digest: str | None, progress) -> None:
    tmp = target.with_name(target.name + PARTIAL)
    target.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256() if digest else None
    with src.open("rb") as fin, tmp.open("wb") as fout:
        while chunk := fin.read(CHUNK):
            fout.write(chunk)
            if h:
                h.update(chunk)
            progress(len(chunk))
        fout.flush()
        os.fsync(fout.fileno())
    got = tmp.stat().st_size
    if got != size:
        tmp.unlink(missing_ok=True)
        raise StagingError(f"copy of {src} is {got:,} bytes, expected {size:,}; the source changed during "
                           "staging or the disk is failing. Re-run stage_weights.")
    if h and h.hexdigest() != digest:
        tmp.unlink(missing_ok=True)
        raise StagingError(f"SHA-256 of {src} is {h.hexdigest()}, {MANIFEST} says {digest}; the source file "
                           "is corrupt: re-download it, then re-run stage_weights.")
    os.replace(tmp, target)


def stage(source: Path, dest: Path, *, progress_every_s: float = 5.0) -> StageReport:
    """Copy `source` into `dest`, resumably; see the module docstring."""
    started = time.monotonic()
    files = list_source(source)
    sums = read_manifest(source)
    unknown = sorted(set(sums) - set(files))
    if unknown:
        raise StagingError(f"{source / MANIFEST} lists files that are not in {source}: {unknown[:5]}; "
                           "the model download is incomplete")
    total = sum(files.values())

    marker = dest / MARKER
    if marker.is_file():
        try:
            recorded = json.loads(marker.read_text()).get("files")
        except json.JSONDecodeError:
            recorded = None
        if recorded == files and all((dest / rel).is_file() for rel in files):
            log.info("weights already staged in %s (%d files, %s): nothing to copy",
                     dest, len(files), human_bytes(total))
            return StageReport(str(dest), len(files), total, 0, 0, len(files), time.monotonic() - started, 0)

    dest.mkdir(parents=True, exist_ok=True)
    todo = {rel: size for rel, size in files.items() if not _already_staged(dest, rel, size, sums.get(rel))}
    needed = sum(todo.values())
    # Space held by stale copies we are about to replace comes back when they are renamed over.
    reclaimable = sum((dest / rel).stat().st_size for rel in todo if (dest / rel).is_file())
    free = shutil.disk_usage(dest).free + reclaimable
    if needed + FREE_MARGIN_BYTES > free:
        raise StagingError(
            f"not enough free space in {dest}: need {human_bytes(needed)} (+{human_bytes(FREE_MARGIN_BYTES)} "
            f"margin) for {len(todo)} files, only {human_bytes(free)} free. {_space_hint(dest, needed)}")
    log.info("staging %d of %d files (%s) from %s to %s; %d already staged",
             len(todo), len(files), human_bytes(needed), source, dest, len(files) - len(todo))

    copied = 0
    last_log = time.monotonic()

    def progress(n: int) -> None:
        nonlocal copied, last_log
        copied += n
        now = time.monotonic()
        if now - last_log >= progress_every_s:
            last_log = now
            elapsed = now - started
            log.info("staged %s / %s (%.0f%%) at %.0f MB/s", human_bytes(copied), human_bytes(needed),
                     100 * copied / max(needed, 1), copied / 1e6 / max(elapsed, 1e-9))

    for rel, size in todo.items():
        _copy_verified(source / rel, dest / rel, size, sums.get(rel), progress)

    tmp_marker = marker.with_name(marker.name + PARTIAL)
    tmp_marker.write_text(json.dumps({"source": str(source), "files": files}, indent=1, sort_keys=True))
    os.replace(tmp_marker, marker)
    report = StageReport(str(dest), len(files), total, len(todo), needed, len(files) - len(todo),
                         time.monotonic() - started, sum(1 for rel in todo if rel in sums))
    log.info("staged %d files (%s) in %.1f s (%.0f MB/s), %d checksums verified", report.copied_files,
             human_bytes(needed), report.seconds, report.mb_per_s, report.verified_checksums)
    return report


def stage_run(cfg: RunConfig, source: Path) -> Staged:
    """Stage `source` to the run's (node's) staging dir; reports/staging.json."""
    report = stage(source, cfg.staging_dir)
    cfg.layout.write_report("staging", report.to_dict())
    return {"model_path": str(cfg.staging_dir), "copied_bytes": report.copied_bytes}


def model_dir(cfg: RunConfig, source: Path) -> Path:
    """Where tokenize and publish read the tokenizer and config: the staged copy when `source` was staged, else
    `source` (a run whose every completion came from the store stages nothing)."""
    marker = cfg.staging_dir / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("source") == str(source):
        return cfg.staging_dir
    return source
