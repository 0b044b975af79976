"""What one task hands another (XCom): each value's keys, declared once.

TypedDicts, so the values stay plain dicts: Airflow's XCom serialises them unchanged, and what a run publishes does
not change. The stage functions return them, tasks.py and the DAG pass them on; mypy sees a renamed key.
Keys a value carries only in some cases are NotRequired.
"""

from __future__ import annotations

from typing import NotRequired, TypeAlias, TypedDict, TypeVar


class Shard(TypedDict):
    """A shard descriptor (`plan_shards`, one per mapped generate/tokenize): never the prompts themselves."""
    shard: int
    path: str  # the shard's prompts file
    prompts: int  # accepted prompts
    label: str  # the map index of its generate task
    to_generate: NotRequired[int]  # what the completion store did not supply (generate/store.py plan_reuse)
    run_prompts: NotRequired[int]  # the run's prompts left to generate, every shard's


class CheckedInputs(TypedDict):
    """Several nodes: `check_inputs`, the run's inputs and lock checked once for all nodes."""
    model_source_dir: str


class Staged(TypedDict):
    """`stage_weights`: the model on the node's RAM disk."""
    model_path: str
    copied_bytes: int


class FleetServer(TypedDict):
    index: int
    url: str
    gpu: str
    pid: int
    log: str


class Fleet(TypedDict):
    """A fleet value (`launch_fleet`, fleet/servers.py fleet_value): its folder and each server."""
    fleet_dir: str
    servers: list[FleetServer]


class Tuned(Fleet):
    """`autotune`: the fleet it leaves (relaunched, or the one launched) with what it chose."""
    mode: str
    skipped: NotRequired[str]
    chosen: NotRequired[str | None]  # the winning candidate's name
    applied_flags: NotRequired[str]
    reused: NotRequired[bool]
    tuning_s: NotRequired[float]


class Health(TypedDict):
    """`health_check`."""
    servers: int
    total_running_slots: int


class Smoke(TypedDict):
    """`smoke_test`."""
    servers: int
    passed: bool


class Calibrated(TypedDict):
    """`calibrate`: whether it measured and, if so, what binds and the predicted wall time."""
    calibrated: bool
    binding: NotRequired[str]
    wall_s: NotRequired[float]
    advised_flags: NotRequired[str]


class NodeReady(TypedDict):
    """Several nodes: `node_ready`, the node's measured rate (None when not calibrated)."""
    node: str
    servers: int
    prompts_per_s: float | None


# Several nodes: `assign_shards`, each node's shards (none for a node left out).
Assignment = dict[str, list[Shard]]


class Generated(TypedDict):
    """`generate`: one shard's counts and its completions file."""
    shard: int
    completed: int
    quarantined: int
    generated_now: int
    path: str
    server: str | None
    output_tokens: NotRequired[int]
    seconds: NotRequired[float]


class Tokenized(TypedDict):
    """`tokenize`: one shard's tokenized samples."""
    shard: int
    samples: int
    skipped: bool  # an earlier run's or attempt's result kept
    tokens: NotRequired[int]
    linked_from: NotRequired[str]


class Validated(TypedDict):
    """`validate`: the counts publish checks the quality report against."""
    kept: int
    quarantined: int


class Published(TypedDict):
    """`publish`: the published version (also the dataset asset event's extra)."""
    path: str
    samples: int
    quarantined: int
    tokens: int


class Verdict(TypedDict):
    """`check_published`: the run published."""
    path: str


T = TypeVar("T")
# What a downstream task gets of a mapped task's results: a list of them, one result alone as itself, none as
# None; a skipped instance has none (Airflow's xcom_pull). tasks.results makes it the list.
Pulled: TypeAlias = list[T] | T | None
