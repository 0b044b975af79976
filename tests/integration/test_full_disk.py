"""A full output disk (a real small tmpfs mounted as the output root; needs root, else skipped) at each stage that
writes results: a shard's checkpoints, tokenize and publish. Each fails at once with a first line that names the
path, the space it needs and the space free; nothing half-written is left to be read back or published; and the
same task resumes once space is freed, with nothing lost or duplicated."""

import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from airflow.sdk.exceptions import AirflowFailException
from conftest import tmpfs

from dflash_regen import tasks
from dflash_regen.demo.model import write_demo_model
from dflash_regen.demo.prompts import write_demo_prompts
from dflash_regen.fleet.servers import stop_fleet
from dflash_regen.layout import COMPLETIONS
from dflash_regen.settings.run_config import RunConfig

RUN = "manual__2026-12-05T03:00:00+00:00"


def fill(root: Path, leave: int) -> Path:
    """Take all but `leave` bytes of the filesystem at `root` with one file; deleting it frees the space again."""
    filler = root / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(shutil.disk_usage(root).free - leave, 0))
    return filler


def hidden_leftovers(root: Path) -> list[str]:
    """Temporary files of an atomic write (`.<name>.<pid>-<id>.tmp`) or of a publish (`.<version>.<id>.tmp/`)."""
    return [str(p) for p in root.rglob(".*.tmp")]


def first_line(exc: pytest.ExceptionInfo) -> str:
    return str(exc.value).splitlines()[0]


NEEDS = r"it needs about [\d,.]+ MB, [\d,.]+ MB are free\. Free space there \(or set Param output_root"


def test_a_full_output_disk_fails_each_stage_clearly_and_the_run_resumes_once_space_is_freed(
        run_params, tmp_path, no_leftover_servers):
    prompts = write_demo_prompts(tmp_path / "prompts.jsonl", 40)
    # Checkpoints of 20 samples (~50 KB each, never sooner by the clock): each needs more than the disk leaves free.
    # A model source outside the output root: the demo's would be written into it (its 11 MB tokenizer included).
    model = write_demo_model(tmp_path / "model", with_tokenizer=True)
    params = run_params(1, prompt_source=str(prompts), shard_size=100, max_bad_row_share=0.5, checkpoint_every=20,
                        checkpoint_s=3600.0, calibration_prompts=0, model_source_dir=str(model))
    write_demo_model(Path(params["staging_dir"]), with_tokenizer=True)  # the staged model: tokenize's tokenizer
    cfg = RunConfig.from_params(params, RUN)
    run, parts = cfg.layout, cfg.layout.parts(COMPLETIONS, 0)
    with tmpfs(tmp_path / "out", "size=12m", "a small tmpfs (a real full disk) as the output root") as root:
        assert cfg.output_root == root
        try:
            tasks.launch_fleet(params, RUN, params["staging_dir"])
            (shard,) = tasks.plan_shards(params, RUN)

            # 1. A shard's checkpoints.
            filler = fill(root, leave=24_000)
            with pytest.raises(AirflowFailException) as full:
                tasks.generate(params, RUN, shard)
            assert re.match(rf"^DiskFull: no space left on the disk of {parts} writing part-\S+\.parquet: {NEEDS}",
                            first_line(full)), first_line(full)
            assert not list(parts.glob("*.parquet")) and hidden_leftovers(root) == []
            filler.unlink()
            generated = tasks.generate(params, RUN, shard)
            ids = pq.read_table(generated["path"], columns=["sample_id"]).column("sample_id").to_pylist()
            assert len(ids) == len(set(ids)) == shard["prompts"] - generated["quarantined"]

            # 2. Tokenize.
            filler = fill(root, leave=24_000)
            with pytest.raises(AirflowFailException) as full:
                tasks.tokenize_shard(params, RUN, generated, shard)
            assert re.match(rf"^DiskFull: no space left on the disk of {run.tokenized(0).parent} writing "
                            rf"{run.tokenized(0).name}: {NEEDS}", first_line(full)), first_line(full)
            assert not run.tokenized(0).exists() and hidden_leftovers(root) == []
            filler.unlink()
            tokenized = tasks.tokenize_shard(params, RUN, generated, shard)
            assert tokenized["samples"] == len(ids)

            # 3. Publish (after the quality gate passed).
            validated = tasks.validate(params, RUN, [shard], [tokenized])
            published = root / "published" / params["dataset_name"]
            filler = fill(root, leave=24_000)
            with pytest.raises(AirflowFailException) as full:
                tasks.publish_dataset(params, RUN, validated)
            assert re.match(rf"^DiskFull: no space left on the disk of {published} writing {run.run_dir.name}: "
                            rf"{NEEDS}", first_line(full)), first_line(full)
            assert list(published.iterdir()) == [] and hidden_leftovers(root) == []  # no version, whole or half
            filler.unlink()
            done = tasks.publish_dataset(params, RUN, validated)
            assert done["samples"] + done["quarantined"] == 40 + 2  # demo prompts: 40 good, 2 bad rows
            assert pq.read_table(Path(done["path"]) / "tokenized").num_rows == done["samples"]
        finally:
            stop_fleet(cfg.fleet_dir)  # before the unmount: the server's log is on the tmpfs


def test_a_json_or_text_write_on_a_full_disk_leaves_the_old_file_whole_and_no_temporary(tmp_path):
    from dflash_regen import atomic

    with tmpfs(tmp_path / "small", "size=256k", "a small tmpfs (a real full disk)") as root:
        atomic.write_json(root / "report.json", {"v": 1})
        with pytest.raises(atomic.DiskFull, match=rf"^no space left on the disk of {root} writing report.json: it "
                                                  r"needs about 0\.50 MB"):
            atomic.write_json(root / "report.json", {"v": "x" * 500_000})
        assert (root / "report.json").read_text() == '{\n "v": 1\n}' and hidden_leftovers(root) == []
