"""A shard's checkpoints: parts written atomically, merged once, each sample once, readable while merged."""

import pyarrow as pa

from dflash_regen.generate import checkpoints

SCHEMA = pa.schema([("sample_id", pa.string())])


def test_reading_what_is_done_while_another_attempt_merges_the_parts_loses_nothing(tmp_path, monkeypatch):
    """A poller (or a retry beside a zombie attempt) lists the parts, then the other attempt merges them away
    before they are read: the read must neither fail nor miss a sample. Seen under load in the resume bench:
    FileNotFoundError on a part the finishing shard had just merged."""
    parts, target = tmp_path / "parts", tmp_path / "shard-00000.parquet"
    checkpoints.write_part(parts, [{"sample_id": "a"}, {"sample_id": "b"}], SCHEMA)
    checkpoints.write_part(parts, [{"sample_id": "c"}], SCHEMA)
    listed = checkpoints.shard_sources

    def merged_right_after_listing(t, folder):
        sources = listed(t, folder)
        if any(p != target for p in sources):  # the other attempt merges between the listing and the reads
            monkeypatch.setattr(checkpoints, "shard_sources", listed)
            checkpoints.merge_parts(folder, t, SCHEMA)
            monkeypatch.setattr(checkpoints, "shard_sources", merged_right_after_listing)
        return sources

    monkeypatch.setattr(checkpoints, "shard_sources", merged_right_after_listing)
    assert checkpoints.read_done(parts, target) == {"a", "b", "c"}
    assert not list(parts.glob("*.parquet"))  # the parts really were merged away during the read


def test_merging_keeps_each_sample_once_whatever_attempt_wrote_it(tmp_path):
    parts, target = tmp_path / "parts", tmp_path / "shard-00000.parquet"
    checkpoints.write_part(parts, [{"sample_id": "a"}, {"sample_id": "b"}], SCHEMA)
    checkpoints.write_part(parts, [{"sample_id": "b"}, {"sample_id": "c"}], SCHEMA)  # a zombie's duplicate
    assert checkpoints.merge_parts(parts, target, SCHEMA) == 3
    checkpoints.write_part(parts, [{"sample_id": "c"}, {"sample_id": "d"}], SCHEMA)
    assert checkpoints.merge_parts(parts, target, SCHEMA) == 4
    assert checkpoints.read_done(parts, target) == {"a", "b", "c", "d"}
