"""Health and allocation gate: is every server alive, and did it get enough memory and slots?

Reads SGLang's `/health` (a 1-token generation in SGLang, so it proves the scheduler answers),
`/server_info` (KV tokens, effective running-request slots, Mamba slots) and the startup log, compares
them with the run's minimums, and explains which resource binds concurrency: the seed's node had room in
its KV cache for hundreds of requests but only 80 Mamba slots, which SGLang turns into 16 running
requests (80 // 5 with `extra_buffer` + spec v2: SGLang's `_calculate_mamba_ratio`, which
emulator/allocation.py reproduces).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from dflash_regen.capacity import Memory, binding_resource
from dflash_regen.errors import DflashError, GateFailed
from dflash_regen.fleet.servers import Server, servers_of
from dflash_regen.fleet.smoke import gated
from dflash_regen.settings.run_config import FleetConfig, RunConfig
from dflash_regen.sglang.api import Allocation, Api, parse_startup_log
from dflash_regen.tables import Column, text_table

__all__ = ["Allocation", "parse_startup_log", "binding_advice", "health_gate", "probe_server"]

log = logging.getLogger(__name__)


@dataclass
class ServerHealth:
    server: str
    url: str
    healthy: bool
    allocation: dict | None = None
    log_figures: dict = field(default_factory=dict)
    version: str = ""  # SGLang's own, from /server_info
    kv_request_capacity: int | None = None  # requests of the run's expected size the KV cache could hold
    binding: str = ""
    advice: str = ""
    problems: list[str] = field(default_factory=list)


def binding_advice(alloc: Allocation, request_tokens: int, log_figures: dict | None = None) -> tuple[int, str, str]:
    """(KV capacity in requests, which resource caps running requests, the flags that would lift it): the
    planner's verdict (`capacity.binding_resource`), worded for the health table."""
    mem = Memory.from_health({"allocation": asdict(alloc), "log_figures": log_figures or {}})
    verdict = binding_resource(mem, request_tokens)
    kv_capacity = verdict.kv_fit
    if verdict.resource == "KV tokens":
        return kv_capacity, "KV tokens", (
            f"the KV cache holds only {kv_capacity} requests of ~{request_tokens:,} tokens: raise "
            "--mem-fraction-static, lower max_tokens, or lower --max-mamba-cache-size to give KV more memory")
    if verdict.resource == "Mamba slots" and (ratio := mem.mamba_ratio):  # Mamba-capped: the ratio is known
        target = min(kv_capacity, max(2 * alloc.running_slots, alloc.running_slots + 1))
        return kv_capacity, f"Mamba slots ({alloc.mamba_slots} // {ratio} = {alloc.running_slots})", (
            f"the KV cache could hold {kv_capacity} such requests; for {target} running requests launch with "
            f"--max-mamba-cache-size {target * ratio} --max-running-requests {target} (costs some KV tokens)")
    mamba_allows = alloc.mamba_slots // mem.mamba_ratio if alloc.mamba_slots and mem.mamba_ratio else "more"
    return kv_capacity, f"--max-running-requests={alloc.max_running_requests or alloc.running_slots}", (
        f"the KV cache could hold {kv_capacity} such requests; raise --max-running-requests "
        f"(Mamba slots allow {mamba_allows})")


def probe_server(server: Server, api_key: str, cfg: FleetConfig, timeout_s: float = 30.0) -> ServerHealth:
    result = ServerHealth(server=server.name, url=server.url, healthy=False)
    api = Api(server.url, api_key, timeout_s=timeout_s)
    try:
        status = api.health()
    except DflashError as exc:
        result.problems.append(f"/health did not answer ({exc}); the server is down or wedged; log: "
                               f"{server.log_path}")
        return result
    if status != 200:
        result.problems.append(f"/health answered HTTP {status}: the scheduler did not produce a "
                               f"token (SGLang runs a 1-token generation); log: {server.log_path}")
        return result
    try:
        with open(server.log_path, "rb") as f:
            f.seek(server.log_offset)  # this launch's startup lines, not an earlier launch's of the same run
            result.log_figures = parse_startup_log(f.read(4 * 1024 * 1024).decode("utf-8", "replace"))
    except FileNotFoundError:
        result.log_figures = {}
    try:
        info = api.server_info()
        alloc = api.allocation(result.log_figures, info)
    except (DflashError, ValueError) as exc:
        result.problems.append(f"/server_info failed: {exc}. It round-trips to the scheduler, so a hang here "
                               "means the scheduler is stuck")
        return result
    result.version = api.version(info)
    result.healthy = True
    result.allocation = asdict(alloc)
    logged_kv = result.log_figures.get("kv_tokens")
    if logged_kv is not None and logged_kv != alloc.kv_tokens:
        result.problems.append(f"startup log says {logged_kv:,} KV tokens but /server_info says "
                               f"{alloc.kv_tokens:,}; check {server.log_path}")
    request_tokens = cfg.expected_prompt_tokens + cfg.expected_output_tokens
    result.kv_request_capacity, result.binding, result.advice = binding_advice(alloc, request_tokens,
                                                                               result.log_figures)
    if alloc.kv_tokens < cfg.min_kv_tokens:
        result.problems.append(f"only {alloc.kv_tokens:,} KV tokens allocated (minimum {cfg.min_kv_tokens:,}): "
                               "another process may hold GPU memory, or --mem-fraction-static / "
                               "--max-total-tokens is too low")
    if alloc.running_slots < cfg.min_running_requests:
        result.problems.append(f"only {alloc.running_slots} running-request slots (minimum "
                               f"{cfg.min_running_requests}), bound by {result.binding}: {result.advice}")
    return result


TABLE_COLUMNS = (Column("server", 40), Column("health", 7), Column("KV tokens", 11, ">", ","),
                 Column("KV GB", 6, ">", ".1f"), Column("slots", 5, ">"), Column("mamba", 5, ">"),
                 Column("KV fits", 7, ">"), Column("binding", gap=2))


def format_table(results: list[ServerHealth]) -> str:
    rows = []
    for r in results:
        a = r.allocation or {}
        rows.append((r.server, "ok" if r.healthy else "DOWN", a.get("kv_tokens", 0), a.get("kv_cache_gb") or 0,
                     a.get("running_slots", 0), a.get("mamba_slots") or 0, r.kv_request_capacity or 0, r.binding))
    return text_table(TABLE_COLUMNS, rows)


def health_gate(servers: list[Server], api_key: str, cfg: FleetConfig) -> dict:
    """Probe every server in parallel; raise `GateFailed` naming each bad one. Returns the report."""
    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        results = list(pool.map(lambda s: probe_server(s, api_key, cfg), servers))
    log.info("fleet allocation (KV fits = requests of %d prompt + %d output tokens the KV cache holds):\n%s",
             cfg.expected_prompt_tokens, cfg.expected_output_tokens, format_table(results))
    for r in results:
        if r.healthy and not r.problems:
            log.info("%s: concurrency bound by %s; %s", r.server, r.binding, r.advice)
    bad = [r for r in results if r.problems]
    report = {"servers": [asdict(r) for r in results], "passed": not bad,
              "total_running_slots": sum((r.allocation or {}).get("running_slots", 0) for r in results)}
    if bad:
        raise GateFailed(f"health check failed on {len(bad)} of {len(results)} servers:\n" + "\n".join(
            f"- {r.server}: " + "; ".join(r.problems) for r in bad))
    return report


def check_fleet(cfg: RunConfig, fleet: dict) -> dict:
    """The health gate on every server of `fleet` (a fleet value), its report in reports/health.json."""
    servers, key = servers_of(fleet, cfg.fleet.num_servers)
    report = gated(cfg.layout, "health", lambda: health_gate(servers, key, cfg.fleet))
    return {"servers": len(servers), "total_running_slots": report["total_running_slots"]}
