"""Every path under `<output_root>/runs/<run_id>/` and the checkpoint rule.
(`<output_root>/store/` is the completion store's: `store_dir`, laid out in generate/store.py.)

    runs/<run_id>/
      fleet/[<node>/]   server-<i>.log, server-<i>.json (pid + launch spec), exit-<i>.json, unhealthy-<i>,
                        unhealthy.jsonl (every marking, kept across relaunches),
                        lease-<i>.lock, api_key, failed-shard-XXXXX.json            (FleetFiles)
      shards/           plan.json, shard-XXXXX.parquet                              (schemas.PROMPT_SHARD)
                        generation.json (the generation fingerprint, generate/store.py)
      completions/      shard-XXXXX.parquet (merged), shard-XXXXX/part-*.parquet    (schemas.COMPLETION)
      failures/         plan.parquet, shard-XXXXX.parquet, shard-XXXXX/part-*.parquet (schemas.QUARANTINE)
      status/           shard-XXXXX.json (generate/status.py)
      drain.json        the operator's drain request (generate/shard.py request_drain)
      tokenized/        shard-XXXXX.parquet, summary-XXXXX.parquet, conversations-XXXXX.jsonl, inputs-XXXXX.json
      quality/          quarantine.parquet                                          (schemas.GATE_QUARANTINE)
      reports/          <name>.json, data_docs/, nodes/<node>/<name>.json
      autotune/[<node>/] candidate-<i>/ (a one-server fleet directory each)
      notifications/    failed-<task>.json (a task failed for good), progress-<n> (sent)  (dflash_regen.notify)

With several nodes the fleet, its reports and its autotune candidates are per node (`node`); everything
else is per run. Beside `runs/`, the output root holds

    run.lock                       the run lock (dflash_regen.fleet.runlock)              (run_lock)
    published/<name>/<run_id>/     a published version, manifest.json in it (dflash_regen.publish)
    demo-model/, demo-prompts/     the demo's stand-in model and prompts, written on first use
    store/                         the completion store                                  (store_dir)

No other module spells these names: a stage, a report page or a test asks the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_regen import atomic

COMPLETIONS, FAILURES = "completions", "failures"  # the two kinds of checkpointed shard results
_SHARD = "shard-"
# The reports (reports/<name>.json) of the fleet, one set per node when there are several; the rest are per run.
NODE_REPORTS = frozenset({"staging", "health", "smoke", "capacity", "autotune", "ready", "left_out"})
_PART_GLOB = "part-*.parquet"


def runs_dir(output_root: Path) -> Path:
    """`<output_root>/runs`: one folder per run id."""
    return output_root / "runs"


def report_file(name: str, suffix: str = ".json") -> str:
    """A report's file name in a reports folder: `<name>.json`, or its table for people to read (`.md`)."""
    return f"{name}{suffix}"


def run_lock(output_root: Path) -> Path:
    """`<output_root>/run.lock`: which run holds the output root (dflash_regen.fleet.runlock)."""
    return output_root / "run.lock"


def published_dir(output_root: Path) -> Path:
    """`<output_root>/published`: one folder per dataset name, one version (run id) in each."""
    return output_root / "published"


def publish_dir(output_root: Path, dataset_name: str, run_id: str) -> Path:
    """`published/<name>/<run_id>/`: where a run's dataset appears, complete or not at all."""
    return published_dir(output_root) / dataset_name / run_id


MANIFEST = "manifest.json"  # in each published version: its counts, tokens, quality, config (dflash_regen.publish)


def manifest(version_dir: Path) -> Path:
    return version_dir / MANIFEST


def published_manifests(output_root: Path, run_id: str) -> list[Path]:
    """The manifests of every dataset name's version `run_id`."""
    return sorted(published_dir(output_root).glob(f"*/{run_id}/{MANIFEST}"))


def demo_model_dir(output_root: Path) -> Path:
    """`demo-model/`: the demo's stand-in model dir (written on first use)."""
    return output_root / "demo-model"


def demo_prompts_file(output_root: Path) -> Path:
    """`demo-prompts/prompts.jsonl`: the demo's prompts (written on first use)."""
    return output_root / "demo-prompts" / "prompts.jsonl"


def store_dir(output_root: Path) -> Path:
    """`<output_root>/store`: the completion store (generate/store.py), hard links of the runs' checkpoints."""
    return output_root / "store"


def shard_name(shard: int) -> str:
    return f"{_SHARD}{shard:05d}"


def shard_of(path: Path) -> int:
    """The shard a file belongs to: `shard-00003.parquet`, `shard-00003/part-*.parquet`, `summary-00003.parquet`."""
    for name in (path.stem, path.parent.name):
        head, _, digits = name.partition("-")
        if digits.isdigit() and head in {"shard", "summary", "conversations"}:
            return int(digits)
    raise ValueError(f"{path} is not a shard's file (expected shard-XXXXX...)")


def shard_sources(merged: Path, parts: Path) -> list[Path]:
    """Every file holding one shard's rows of one kind: its merged file (if any) first, then each checkpoint
    part. A merge reads them all and removes the parts; ids read from them are taken as a set, since a part
    left by a kill between a merge's rename and its unlinks repeats merged rows."""
    return ([merged] if merged.is_file() else []) + (sorted(parts.glob(_PART_GLOB)) if parts.is_dir() else [])


def counted_files(merged: Path, parts: Path) -> list[Path]:
    """The checkpoint rule, for counting rows: a shard's merged file when it exists (parts left beside it
    repeat its rows), else its checkpoint parts. Each row is in exactly one of the files returned."""
    if merged.is_file():
        return [merged]
    return sorted(parts.glob(_PART_GLOB)) if parts.is_dir() else []


def new_part(parts: Path, stamp_ns: int, tag: str) -> Path:
    """A checkpoint part's name: sorted by time, unique across concurrent attempts of one shard."""
    return parts / f"part-{stamp_ns:020d}-{tag}.parquet"


@dataclass(frozen=True)
class FleetFiles:
    """What the fleet (and generation's leases) record in one fleet directory: `fleet/`, `fleet/<node>/`, or
    an autotune candidate's."""

    dir: Path

    @property
    def api_key(self) -> Path:
        return self.dir / "api_key"

    def server_log(self, index: int) -> Path:
        return self.dir / f"server-{index}.log"

    def server_spec(self, index: int) -> Path:
        return self.dir / f"server-{index}.json"

    def server_specs(self) -> list[Path]:
        """Every recorded server's spec, by server index."""
        return sorted(self.dir.glob("server-*.json"), key=lambda p: int(p.stem.split("-")[1]))

    def exit_record(self, index: int) -> Path:
        return self.dir / f"exit-{index}.json"

    def unhealthy(self, index: int) -> Path:
        return self.dir / f"unhealthy-{index}"

    def unhealthy_markers(self) -> list[Path]:
        return sorted(self.dir.glob("unhealthy-*"))

    @property
    def unhealthy_log(self) -> Path:
        """Every server ever marked unhealthy (JSON lines); outlives a relaunch, so the pages keep the history."""
        return self.dir / "unhealthy.jsonl"

    def launch_markers(self) -> list[Path]:
        """What a fresh launch clears: the unhealthy markers and exit records of the fleet before it."""
        return [*self.unhealthy_markers(), *sorted(self.dir.glob("exit-*.json"))]

    def lease_lock(self, index: int) -> Path:
        return self.dir / f"lease-{index}.lock"

    def failed_shard(self, shard: int) -> Path:
        """Where `shard` failed before; outlives a relaunch (unlike the unhealthy markers)."""
        return self.dir / f"failed-{shard_name(shard)}.json"


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run folder, as one node sees it (`node` = "" for the one-node deployment)."""

    run_dir: Path
    node: str = ""

    @classmethod
    def of(cls, output_root: Path, run_id: str, node: str = "") -> RunLayout:
        return cls(runs_dir(output_root) / run_id, node)

    # ------------------------------------------------------------------------------------------- fleet
    @property
    def fleet_dir(self) -> Path:
        return self.run_dir / "fleet" / self.node if self.node else self.run_dir / "fleet"

    @property
    def fleet(self) -> FleetFiles:
        return FleetFiles(self.fleet_dir)

    def fleet_dirs(self) -> list[Path]:
        """fleet/ and, for a run on several nodes, each fleet/<node>/ (for readers of the whole run)."""
        top = self.run_dir / "fleet"
        return [top, *sorted(p for p in top.glob("*") if p.is_dir())]

    @property
    def autotune_dir(self) -> Path:
        return self.run_dir / "autotune" / self.node if self.node else self.run_dir / "autotune"

    def autotune_candidate(self, index: int) -> Path:
        """The fleet directory of one autotune candidate (a one-server fleet)."""
        return self.autotune_dir / f"candidate-{index}"

    # ------------------------------------------------------------------------------------------ shards
    @property
    def shards_dir(self) -> Path:
        return self.run_dir / "shards"

    @property
    def plan(self) -> Path:
        """shards/plan.json: the shard descriptors and the input's fingerprint (planning's record)."""
        return self.shards_dir / "plan.json"

    def shard(self, shard: int) -> Path:
        """A planned shard's prompts."""
        return self.shards_dir / f"{shard_name(shard)}.parquet"

    def shard_files(self) -> list[Path]:
        return sorted(self.shards_dir.glob(f"{_SHARD}*.parquet"))

    # ------------------------------------------------------------------------ completions and failures
    def results_dir(self, kind: str) -> Path:
        if kind not in (COMPLETIONS, FAILURES):
            raise ValueError(f"no shard results of kind {kind!r}; expected {COMPLETIONS!r} or {FAILURES!r}")
        return self.run_dir / kind

    def merged(self, kind: str, shard: int) -> Path:
        """A shard's merged result file (each sample once), written when the shard is done."""
        return self.results_dir(kind) / f"{shard_name(shard)}.parquet"

    def parts(self, kind: str, shard: int) -> Path:
        """The folder of a shard's checkpoint parts (removed by the merge)."""
        return self.results_dir(kind) / shard_name(shard)

    def merged_files(self, kind: str) -> list[Path]:
        """Every shard's merged result file of `kind` (shards still running have none)."""
        return sorted(self.results_dir(kind).glob(f"{_SHARD}*.parquet"))

    def result_files(self, kind: str, shard: int | None = None) -> list[Path]:
        """The checkpoint rule over the run (or one shard): merged shard files plus the parts of shards not
        merged yet; each row is in one file only."""
        folder = self.results_dir(kind)
        shards = [shard] if shard is not None else sorted({shard_of(p) for p in folder.glob(f"{_SHARD}*")})
        return [p for n in shards for p in counted_files(self.merged(kind, n), self.parts(kind, n))]

    @property
    def generation_record(self) -> Path:
        """shards/generation.json: the run's generation fingerprint, written when it plans; the completion store
        indexes the run's completion files by it."""
        return self.shards_dir / "generation.json"

    @property
    def planning_quarantine(self) -> Path:
        """failures/plan.parquet: the rows planning refused."""
        return self.results_dir(FAILURES) / "plan.parquet"

    def failure_files(self) -> list[Path]:
        """Every quarantine before the quality gate: planning's and each finished shard's."""
        return sorted(self.results_dir(FAILURES).glob("*.parquet"))

    # -------------------------------------------------------------------------------------- status
    @property
    def status_dir(self) -> Path:
        return self.run_dir / "status"

    @property
    def drain_request(self) -> Path:
        """drain.json: who asked the run to drain, and when (`generate.shard.request_drain`); a relaunch removes it."""
        return self.run_dir / "drain.json"

    def status(self, shard: int) -> Path:
        """status/shard-XXXXX.json: the shard's heartbeat and attempts (generate/status.py)."""
        return self.status_dir / f"{shard_name(shard)}.json"

    def status_files(self) -> list[Path]:
        return sorted(self.status_dir.glob(f"{_SHARD}*.json"))

    # ------------------------------------------------------------------------------- notifications
    @property
    def notifications_dir(self) -> Path:
        """notifications/: each task that failed for good (the run-failed message lists them) and the progress
        messages sent (dflash_regen.notify)."""
        return self.run_dir / "notifications"

    # ------------------------------------------------------------------------------------ tokenized
    @property
    def tokenized_dir(self) -> Path:
        return self.run_dir / "tokenized"

    def tokenized(self, shard: int) -> Path:
        return self.tokenized_dir / f"{shard_name(shard)}.parquet"

    def summary(self, shard: int) -> Path:
        return self.tokenized_dir / f"summary-{shard:05d}.parquet"

    def conversations(self, shard: int) -> Path:
        return self.tokenized_dir / f"conversations-{shard:05d}.jsonl"

    def tokenized_inputs(self, shard: int) -> Path:
        """What the shard's tokenized files were made from, as a key another run can match (training/reuse.py)."""
        return self.tokenized_dir / f"inputs-{shard:05d}.json"

    def tokenized_files(self) -> list[Path]:
        return sorted(self.tokenized_dir.glob(f"{_SHARD}*.parquet"))

    def summary_files(self) -> list[Path]:
        return sorted(self.tokenized_dir.glob("summary-*.parquet"))

    # ----------------------------------------------------------------------------------------- quality
    @property
    def gate_quarantine(self) -> Path:
        """quality/quarantine.parquet: the samples the quality gate's row rules refused."""
        return self.run_dir / "quality" / "quarantine.parquet"

    # -------------------------------------------------------------------------------------- reports
    @property
    def reports_dir(self) -> Path:
        return self.run_dir / "reports"

    def report(self, name: str) -> Path:
        """reports/<name>.json: a report of the whole run (plan, quality, assignment...)."""
        return self.reports_dir / report_file(name)

    def write_report(self, name: str, report: dict) -> Path:
        """Write a report where it belongs: the fleet's own (NODE_REPORTS) per node, the others per run."""
        path = self.node_report(name) if name in NODE_REPORTS else self.report(name)
        atomic.write_json(path, report)
        return path

    @property
    def data_docs(self) -> Path:
        return self.reports_dir / "data_docs"

    @property
    def data_docs_index(self) -> Path:
        return self.data_docs / "index.html"

    @property
    def nodes_reports_dir(self) -> Path:
        """reports/nodes/: one folder per node of a run on several nodes."""
        return self.reports_dir / "nodes"

    def reports_of(self, node: str) -> Path:
        """A node's own reports folder (reports/nodes/<node>/); reports/ itself for "" (one node)."""
        return self.nodes_reports_dir / node if node else self.reports_dir

    @property
    def node_reports_dir(self) -> Path:
        """The fleet's reports (staging, health, smoke, capacity, autotune): per node when there are several."""
        return self.reports_of(self.node)

    def node_report(self, name: str, node: str | None = None) -> Path:
        """<name>.json among this node's reports (or `node`'s)."""
        return self.reports_of(self.node if node is None else node) / report_file(name)

    def report_nodes(self) -> list[str]:
        """The nodes that have a reports folder, by name."""
        return sorted(p.name for p in self.nodes_reports_dir.glob("*") if p.is_dir())
