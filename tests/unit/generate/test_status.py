"""A shard's status file: one record per attempt, kept across attempts, the failure's first line."""

from dflash_regen.generate.status import ShardStatus, read
from dflash_regen.layout import RunLayout


def test_attempts_accumulate_and_a_failure_keeps_its_first_line(tmp_path):
    path = RunLayout(tmp_path).status(3)
    first = ShardStatus(path, 3, total=20, server="server 2", done_before=0, quarantined_before=0)
    first.update(done=4, quarantined=1, output_tokens=800)
    assert read(path)["attempts"][0]["state"] == "running"  # what a killed task leaves behind
    first.finish("failed", RuntimeError("server 2 was killed by SIGKILL\nTraceback (most recent call last): ..."))
    second = ShardStatus(path, 3, total=20, server="server 5", done_before=4, quarantined_before=1)
    second.update(done=19, quarantined=1, output_tokens=3000)
    second.finish("done")
    status = read(path)
    assert (status["state"], status["server"], status["done"], status["quarantined"]) == ("done", "server 5", 19, 1)
    failed, retried = status["attempts"]
    assert (failed["state"], failed["server"], failed["done"]) == ("failed", "server 2", 4)
    assert failed["error"] == "server 2 was killed by SIGKILL"
    assert (retried["state"], retried["done_before"], retried["done"]) == ("done", 4, 19)
    assert not list(path.parent.glob(".*.tmp"))  # written by rename
