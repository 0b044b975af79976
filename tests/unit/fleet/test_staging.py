import hashlib
import json
import shutil
from pathlib import Path

import pytest

from dflash_regen.demo.model import write_demo_model
from dflash_regen.errors import StagingError
from dflash_regen.fleet import staging


@pytest.fixture
def source(tmp_path):
    return write_demo_model(tmp_path / "src", shards=3, shard_bytes=1 << 20)


def test_stage_copies_verifies_and_marks_complete(source, tmp_path):
    dest = tmp_path / "shm" / "model"
    report = staging.stage(source, dest)
    assert report.copied_files == report.files == 5  # config, 3 shards, SHA256SUMS
    assert report.verified_checksums == 4
    for f in source.iterdir():
        assert (dest / f.name).read_bytes() == f.read_bytes()
    assert not list(dest.glob("*.partial"))
    assert json.loads((dest / staging.MARKER).read_text())["files"] == staging.list_source(source)


def test_second_stage_is_skipped_by_the_marker(source, tmp_path):
    dest = tmp_path / "dest"
    staging.stage(source, dest)
    again = staging.stage(source, dest)
    assert again.copied_files == 0 and again.skipped_files == again.files


def test_interrupted_stage_resumes_copying_only_what_is_missing(source, tmp_path):
    dest = tmp_path / "dest"
    dest.mkdir()
    shutil.copy(source / "model-00001-of-00003.safetensors", dest)  # finished before the crash
    (dest / "model-00002-of-00003.safetensors.partial").write_bytes(b"half")  # interrupted mid-copy
    report = staging.stage(source, dest)
    assert report.skipped_files == 1 and report.copied_files == 4
    assert not list(dest.glob("*.partial"))
    assert staging._sha256(dest / "model-00002-of-00003.safetensors") == staging.read_manifest(source)[
        "model-00002-of-00003.safetensors"]


def test_a_corrupt_staged_file_is_replaced(source, tmp_path):
    dest = tmp_path / "dest"
    staging.stage(source, dest)
    (dest / staging.MARKER).unlink()
    target = dest / "model-00003-of-00003.safetensors"
    target.write_bytes(b"x" * target.stat().st_size)  # same size, wrong bytes
    report = staging.stage(source, dest)
    assert report.copied_files == 1
    assert target.read_bytes() == (source / target.name).read_bytes()


def test_checksum_mismatch_in_the_source_fails_and_leaves_no_partial(source, tmp_path):
    shard = source / "model-00001-of-00003.safetensors"
    shard.write_bytes(b"\0" * shard.stat().st_size)  # corrupt after the manifest was written
    with pytest.raises(StagingError, match="SHA-256 of .*model-00001.* is corrupt"):
        staging.stage(source, tmp_path / "dest")
    assert not (tmp_path / "dest" / "model-00001-of-00003.safetensors").exists()
    assert not list((tmp_path / "dest").glob("*.partial"))


def test_not_enough_space_fails_before_copying_with_needed_and_free(source, tmp_path, monkeypatch):
    free = 100 * 1024 * 1024
    monkeypatch.setattr(staging.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - free, free))
    dest = tmp_path / "dest"
    with pytest.raises(StagingError) as info:
        staging.stage(source, dest)
    msg = str(info.value)
    assert "need 3.15 MB" in msg and "only 104.86 MB free" in msg and "staging_dir" in msg
    assert not any(p.is_file() for p in dest.iterdir())


def test_a_containers_own_small_dev_shm_names_the_compose_volume_that_mounts_the_nodes(source, tmp_path,
                                                                                       monkeypatch):
    """Docker gives a container 64 MB of /dev/shm unless the host's is mounted: the first line says which."""
    marker = tmp_path / ".dockerenv"
    monkeypatch.setattr(staging, "CONTAINER_MARKER", marker)
    monkeypatch.setattr(staging.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(2**26, 0, 2**26))
    dest = Path("/dev/shm") / f"dflash-test-{tmp_path.name}"
    try:
        for in_container in (False, True):
            if in_container:
                marker.write_text("")
            with pytest.raises(StagingError) as info:
                staging.stage(source, dest)
            first = str(info.value).splitlines()[0]
            assert "need 3.15 MB" in first and "only 67.11 MB free" in first, first
            assert ("`- /dev/shm:/dev/shm`" in first and "shm_size" in first) == in_container, first
        assert not any(p.is_file() for p in dest.iterdir())
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def test_source_without_config_is_rejected_clearly(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(StagingError, match="no config.json"):
        staging.stage(tmp_path / "empty", tmp_path / "dest")
    with pytest.raises(StagingError, match="not a directory"):
        staging.stage(tmp_path / "missing", tmp_path / "dest")


def test_malformed_manifest_names_the_line(source, tmp_path):
    (source / staging.MANIFEST).write_text("nothex config.json\n")
    with pytest.raises(StagingError, match=r"SHA256SUMS:1"):
        staging.stage(source, tmp_path / "dest")


def test_demo_model_is_deterministic(tmp_path):
    a = write_demo_model(tmp_path / "a")
    b = write_demo_model(tmp_path / "b")
    assert (a / "SHA256SUMS").read_text() == (b / "SHA256SUMS").read_text()
    assert hashlib.sha256((a / "config.json").read_bytes()).hexdigest() in (a / "SHA256SUMS").read_text()


def test_tokenize_and_publish_read_the_staged_copy_only_of_this_source(source, tmp_path):
    from dflash_regen.settings.run_config import DEFAULTS, RunConfig

    params = {**DEFAULTS, "output_root": str(tmp_path / "out"), "staging_dir": str(tmp_path / "shm")}
    cfg = RunConfig.from_params(params, "r1")
    assert staging.model_dir(cfg, source) == source  # nothing staged (the store supplied the run)
    staging.stage_run(cfg, source)
    assert staging.model_dir(cfg, source) == cfg.staging_dir
    assert json.loads(cfg.layout.node_report("staging").read_text())["copied_bytes"] > 0
    other = write_demo_model(tmp_path / "other", shards=1, shard_bytes=1 << 10)
    assert staging.model_dir(cfg, other) == other  # the staged copy is another model's
