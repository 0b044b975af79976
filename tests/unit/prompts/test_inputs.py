"""The run's inputs checked before any GPU work: output root, prompt source, and the output root's run lock."""

import gzip
import json

import pytest
from conftest import tmpfs

from dflash_regen.errors import ConfigError
from dflash_regen.prompts import inputs
from dflash_regen.prompts.sources import PromptSourceError

GOOD = {"id": "a", "messages": [{"role": "user", "content": "hi"}]}


def test_an_output_root_under_a_file_names_the_param_and_the_fix(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"^Param output_root '.*/file/out' is not writable by uid \d+ \(Not a "
                                          r"directory\): "
                                          "set it to a directory this worker can write"):
        inputs.check_output_root(tmp_path / "file" / "out")
    inputs.check_output_root(tmp_path / "new" / "out")
    assert (tmp_path / "new" / "out").is_dir() and not list((tmp_path / "new" / "out").iterdir())


def test_a_read_only_output_root_names_the_param(tmp_path):
    with tmpfs(tmp_path / "ro", "ro,size=1m", "a read-only filesystem") as ro, \
            pytest.raises(ConfigError, match=r"^Param output_root '.*/ro/out' is not writable by uid \d+ \(Read-only "
                                             r"file system\)"):
        inputs.check_output_root(ro / "out")


def test_a_missing_source_or_a_folder_without_prompt_files_names_the_param(tmp_path):
    with pytest.raises(PromptSourceError, match=r"does not exist; set Param prompt_source"):
        inputs.check_prompt_source(tmp_path / "nope.jsonl")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "README.md").write_text("prompts go here")
    with pytest.raises(PromptSourceError, match=r"has no readable files .*found \['README.md'\]"):
        inputs.check_prompt_source(tmp_path / "docs")


def test_a_source_with_no_usable_row_names_the_param_and_the_reasons(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"^Param prompt_source '.*empty.jsonl' has no rows"):
        inputs.check_prompt_source(empty)
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as f:
        f.write("not json\n" + json.dumps({"text": "no messages"}) + "\n")
    with pytest.raises(ConfigError, match=r"^Param prompt_source '.*bad.jsonl.gz': none of its first 2 rows is a "
                                          r"usable prompt, e.g. not_json \(bad.jsonl.gz:1: "):
        inputs.check_prompt_source(bad)


def test_a_usable_row_after_bad_ones_passes(tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text("{}\n" + json.dumps(GOOD) + "\n")
    assert inputs.check_prompt_source(src) == "p.jsonl:2"
