"""The skip decision: a run the completion store completes needs no weights and no fleet."""

from __future__ import annotations

from pathlib import Path

from dflash_regen.errors import NothingToGenerate
from dflash_regen.fleet import staging
from dflash_regen.generate import store
from dflash_regen.payloads import Shard, Staged
from dflash_regen.settings import nodes
from dflash_regen.settings.run_config import RunConfig


def stage_unless_stored(cfg: RunConfig, source: Path, shards: list[Shard] | None) -> Staged:
    """The stage_weights task: the weights at `source` staged to the node's RAM disk, unless the store holds every
    prompt's completion of `shards` (one node's plan; None with several nodes, whose split comes after staging):
    then `NothingToGenerate`, and the fleet's setups and teardown skip after it."""
    if shards is not None and (why := store.nothing_to_generate(shards)):  # type: ignore[arg-type]
        raise NothingToGenerate(why)
    nodes.forget_decision(cfg.layout)  # a run (or the same run id again) decides afresh whether the node takes part
    return staging.stage_run(cfg, source)
