"""GPU nodes of a deployment, and how a run's shards are split among them.

A deployment names its nodes in the environment variable `DFLASH_NODES` (read when the DAG is parsed, so every
Airflow component needs the same value), a JSON list with one object per node:

    [{"name": "rtx", "queue": "gpu-node-1", "gpus": "0,1,2,3", "staging_dir": "/dev/shm/Qwen3.6-27B",
      "base_port": 30000, "server_command": "/opt/sglang-venv/bin/python -m sglang.launch_server"},
     {"name": "b200", "queue": "gpu-node-2", "gpus": "0,1,2,3,4,5,6"}]

Only `name` is required; a field left out keeps the run's Param (`gpus` sets `gpu_ids` and `num_servers`).
`emulator_profile` (the emulator's speed) lets the tests give each emulated node its own decode rate.
Unset, the deployment is one node on `DFLASH_WORKER_QUEUE` (or Airflow's default queue) and the DAG is the
one-node DAG. Airflow cannot map `queue` (apache/airflow#22867), so the DAG builds one task group per node.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_regen.errors import ConfigError, GateFailed
from dflash_regen.layout import RunLayout
from dflash_regen.payloads import Assignment, Shard
from dflash_regen.settings.deployment import NODES_ENV
from dflash_regen.settings.params import key_of

log = logging.getLogger(__name__)

READY, LEFT_OUT = "ready", "left_out"  # a node's reports: it passed its gates, or why it is left out
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,49}")
_FIELDS = {"name", "queue", "gpus", "staging_dir", "base_port", "server_command", "emulator_profile"}
# What a node sets instead of the run's Param: the config field that Param fills.
_FILLS = {"staging_dir": "RunConfig.staging_dir", "base_port": "FleetConfig.base_port",
          "server_command": "FleetConfig.server_command", "emulator_profile": "FleetConfig.emulator_profile"}


@dataclass(frozen=True)
class Node:
    name: str
    queue: str = ""  # Celery queue of the node's worker; "" = Airflow's default queue
    gpus: str = ""  # CUDA_VISIBLE_DEVICES per server, "0,1,2"; "" = the run's Params
    staging_dir: str = ""
    base_port: int | None = None
    server_command: str = ""
    emulator_profile: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def apply(self, params: dict) -> dict:
        """The run's Params as this node sees them."""
        out = dict(params)
        for name, path in _FILLS.items():
            value = getattr(self, name)
            if value not in ("", None, {}):
                out[key_of(path)] = value
        if self.gpus:
            out[key_of("FleetConfig.gpu_ids")] = self.gpus
            out[key_of("FleetConfig.num_servers")] = len(self.gpus.split(","))
        return out


def _fail(text: str, why: str) -> ConfigError:
    return ConfigError(f"environment variable {NODES_ENV} is invalid: {why}. It must be a JSON list of nodes, e.g. "
                       '[{"name": "rtx", "queue": "gpu-node-1", "gpus": "0,1,2,3"}, {"name": "b200", "queue": '
                       f'"gpu-node-2"}}] (see dflash_regen/settings/nodes.py); got {text[:200]!r}')


def parse_nodes(text: str | None) -> list[Node]:
    """The nodes `DFLASH_NODES` names; [] when unset (one node, the one-node DAG)."""
    if text is None or not text.strip():
        return []
    try:
        items = json.loads(text)
    except ValueError as exc:
        raise _fail(text, f"not JSON ({exc})") from exc
    if not isinstance(items, list) or not items:
        raise _fail(text, "not a non-empty list")
    nodes, names = [], set()
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise _fail(text, f"{item!r} is not an object with a 'name'")
        if unknown := set(item) - _FIELDS:
            raise _fail(text, f"node {item['name']!r} has unknown fields {sorted(unknown)} (known: {sorted(_FIELDS)})")
        if not _NAME.fullmatch(item["name"]) or item["name"] in names:
            raise _fail(text, f"node name {item['name']!r} is not unique letters, digits, '_' or '-' (it names a "
                              "task group)")
        gpus = str(item.get("gpus", "")).replace(" ", "")
        if gpus and not re.fullmatch(r"\d+(,\d+)*", gpus):
            raise _fail(text, f"node {item['name']!r} gpus {gpus!r} is not comma-separated GPU numbers")
        port = item.get("base_port")
        if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 1024 <= port <= 65000):
            raise _fail(text, f"node {item['name']!r} base_port {port!r} is not a port number (1024-65000)")
        if not isinstance(item.get("emulator_profile", {}), dict):
            raise _fail(text, f"node {item['name']!r} emulator_profile is not an object")
        names.add(item["name"])
        nodes.append(Node(name=item["name"], queue=str(item.get("queue") or ""), gpus=gpus,
                          staging_dir=str(item.get("staging_dir") or ""), base_port=port,
                          server_command=str(item.get("server_command") or ""),
                          emulator_profile=dict(item.get("emulator_profile") or {})))
    return nodes


def assign(shards: list[Shard], rates: dict[str, float]) -> dict[str, list[Shard]]:
    """Each shard to the node predicted to finish it first (prompts already given / prompts per second),
    largest shards first: every node gets prompts in proportion to its rate, to within one shard."""
    if not rates or min(rates.values()) <= 0:
        raise ValueError(f"every node needs a positive rate, got {rates}")
    given = {name: 0 for name in rates}
    out: dict[str, list[Shard]] = {name: [] for name in rates}
    for shard in sorted(shards, key=lambda s: (-s["prompts"], s["shard"])):
        name = min(rates, key=lambda n: ((given[n] + shard["prompts"]) / rates[n], list(rates).index(n)))
        given[name] += shard["prompts"]
        out[name].append(shard)
    for name in out:
        out[name].sort(key=lambda s: s["shard"])
    return out


def record_left_out(layout: RunLayout, node: str, task: str, error: BaseException) -> None:
    """Several nodes, Param node_failure = continue: `node` is left out of the run, its `task` failed with `error`
    (reports/nodes/<node>/left_out.json, which `assign_run` reads)."""
    layout.write_report(LEFT_OUT, {"node": node, "task": task, "error": str(error), "at": time.time()})


def forget_decision(layout: RunLayout) -> None:
    """A run (or the same run id again) decides afresh whether the node takes part: its ready and left-out records
    go when it stages."""
    for name in (READY, LEFT_OUT):
        layout.node_report(name).unlink(missing_ok=True)


def assign_run(layout: RunLayout, shards: list[Shard], node_names: list[str], keep_going: bool
               ) -> Assignment:
    """Shards to the nodes that passed their gates, in proportion to each one's calibrated rate (prompts/s of its
    fleet; by healthy server count when a node was not calibrated): each node's shards (none for a node left
    out), the split in `reports/assignment.json`. A node left out fails the run unless `keep_going` (Param
    node_failure = continue)."""
    ready, left_out = {}, {}
    for name in node_names:
        ready_file, left_out_file = layout.node_report(READY, name), layout.node_report(LEFT_OUT, name)
        if ready_file.is_file():
            ready[name] = json.loads(ready_file.read_text())
        else:
            record = json.loads(left_out_file.read_text()) if left_out_file.is_file() else {}
            left_out[name] = record.get("error", "its setup tasks did not finish")
    if left_out and not keep_going:
        raise GateFailed(f"nodes {', '.join(left_out)} failed their setup ({'; '.join(left_out.values())}); set Param "
                         "node_failure to 'continue' to run on the other nodes")
    if not ready:
        raise GateFailed(f"no node passed its gates: {left_out}; fix them (see each node's setup task logs)")
    calibrated = all(r["prompts_per_s"] for r in ready.values())
    rates = {n: (r["prompts_per_s"] if calibrated else float(r["servers"])) for n, r in ready.items()}
    assigned = assign(shards, rates)
    basis = "calibrated prompts/s" if calibrated else "healthy servers (not every node was calibrated)"
    report: dict = {"basis": basis, "left_out": left_out, "assigned_at": time.time(), "nodes": {}}
    total_rate = sum(rates.values())
    for name, mine in assigned.items():
        prompts = sum(s["prompts"] for s in mine)
        report["nodes"][name] = {
            "shards": [s["shard"] for s in mine], "prompts": prompts, "rate": round(rates[name], 4),
            "rate_share": round(rates[name] / total_rate, 4), "servers": ready[name]["servers"],
            "predicted_s": round(prompts / rates[name], 1) if calibrated else None}
        log.info("node %s: %d shards, %d prompts (rate %.3g, %.0f%% of the run's)", name, len(mine), prompts,
                 rates[name], 100 * rates[name] / total_rate)
    for name, why in left_out.items():
        log.warning("node %s is left out: %s", name, why)
    layout.write_report("assignment", report)
    return {name: assigned.get(name, []) for name in node_names}


def split_report(layout: RunLayout) -> dict | None:
    """Per node: shards and prompts assigned, predicted and measured generation time, samples completed; None
    for a one-node run."""
    assignment = _json(layout.report("assignment"))
    if not assignment:
        return None
    out = {"basis": assignment["basis"], "left_out": assignment["left_out"], "nodes": {}}
    for name, node in assignment["nodes"].items():
        starts, ends, busy, done = [], [], 0.0, 0
        for shard in node["shards"]:
            status = _json(layout.status(shard)) or {}
            attempts = status.get("attempts", [])
            starts += [a["started_at"] for a in attempts]
            ends += [a.get("ended_at", a["updated_at"]) for a in attempts]
            busy += sum(a.get("ended_at", a["updated_at"]) - a["started_at"] for a in attempts)
            done += status.get("done", 0) if status.get("state") == "done" else 0
        out["nodes"][name] = {
            **node, "done": done,
            # wall time on the node, Airflow's task start-up and queueing included
            "measured_s": round(max(ends) - min(starts), 1) if starts else None,
            # what predicted_s estimates: shard time per server (the shards kept every server busy)
            "generating_s": round(busy / max(node.get("servers") or 1, 1), 1)}
    return out


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
