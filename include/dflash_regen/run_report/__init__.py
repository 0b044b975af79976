"""What a run says, as plain dicts: the data behind the UI's runs list, data-quality and fleet pages.

Two sources. The run folder `<output_root>/runs/<run_id>/` (reports/*.json, each shard's status file, the
shard, completion and failure parquet files) says what the pipeline did and works while the run is going and
long after it ended. Airflow's view of the run (`airflow_run`: its id, state, dates and task instances, passed
in by the plugin as a plain dict; None outside Airflow) says what the folder cannot: a run marked failed, a
task killed before it wrote anything, where the run stopped.

At scale (902 shards, 902K completions) a page view must not re-read the run: parquet reads are cached per
file (path, mtime, size), so a refresh reads only the checkpoint parts written since the last one.

Modules: `runs` (the runs list, a run's state), `quality_page`, `fleet_page` (each page's data), `files` (the
cached reads they share).
"""

from dflash_regen.errors import RunNotFound
from dflash_regen.run_report.fleet_page import (
    ADVICE_MIN_GAIN,
    SHARDS_LISTED,
    SLOW_SHARE,
    THROUGHPUT_POINTS,
    capacity_advice,
    fleet_report,
    incidents,
    kv_headroom,
    nodes_report,
    progress,
    shards,
    short_name,
    throughput_series,
)
from dflash_regen.run_report.quality_page import (
    HISTOGRAM_BINS,
    histogram,
    quality_report,
    quarantine_by_stage,
    threshold,
)
from dflash_regen.run_report.runs import PIPELINE, RUNNING_STATES, list_runs, resolve_run, run_root, run_state

__all__ = [
    "ADVICE_MIN_GAIN", "HISTOGRAM_BINS", "PIPELINE", "RUNNING_STATES", "RunNotFound", "SHARDS_LISTED", "SLOW_SHARE",
    "THROUGHPUT_POINTS", "capacity_advice", "fleet_report", "histogram", "incidents", "kv_headroom", "list_runs",
    "nodes_report", "progress", "quality_report", "quarantine_by_stage", "resolve_run", "run_root", "run_state",
    "shards", "short_name", "threshold", "throughput_series",
]
