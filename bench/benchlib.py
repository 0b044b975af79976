"""Shared by the benchmarks: emulated fleets, prompt files, measured child processes, one shard task, the
plain reference client, and the result format (figures, each a side-by-side ratio with its raw numbers).

Also a small CLI, so a shard task or the plain client runs in its own process (its CPU and peak RSS are
then its own, read with `os.wait4`):

    python bench/benchlib.py shard PARAMS_JSON RUN_ID SHARD_DESCRIPTOR_JSON   # tasks.generate
    python bench/benchlib.py plain PARAMS_JSON RUN_ID SHARD_PARQUET SERVER_INDEX
    python bench/benchlib.py plan PARAMS_JSON RUN_ID SOURCE                # plan_shards; prints shard 0
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SLOTS = 16  # running-request slots per server: the seed's B200 allocation
# The emulator answering as fast as it can, so what is left to measure is the client's (or Airflow's) cost.
ZERO_LATENCY = {"decode_tokens_per_s": 1e7, "prefill_tokens_per_s": 1e9, "startup_s": 0.1}


def free_port_block(n: int) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import free_port_block as block  # the tests' finder: loopback, random free ports

    return block(n)


# -------------------------------------------------------------------------------------------- results
def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the benchmark runs, not the figures")
    ap.add_argument("--out", type=Path, default=BENCH / "results")
    return ap


def figure(number: int, name: str, ratio: float | None, ratio_of: str, ideal: str, **raw) -> dict:
    """One table row: a ratio of two quantities measured side by side in one run, with the raw numbers."""
    return {"figure": number, "name": name, "ratio": None if ratio is None else round(ratio, 3),
            "ratio_of": ratio_of, "ideal": ideal, "raw": raw}


def write_result(out: Path, benchmark: str, figures: list[dict], details: dict) -> dict:
    report = {"benchmark": benchmark, "machine": machine(), "figures": figures, "details": details}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{benchmark}.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return report


def machine() -> dict:
    mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal:"))
    return {"arch": platform.machine(), "cores": os.cpu_count(), "ram_gb": round(mem_kb / 1024**2, 1),
            "python": platform.python_version(), "date": datetime.now(UTC).strftime("%Y-%m-%d")}


def work_dir(name: str) -> Path:
    """A private temp dir, removed at exit (up to ~1 GB of prompts and shards) unless DFLASH_BENCH_KEEP=1."""
    path = Path(tempfile.mkdtemp(prefix=f"dflash-bench-{name}-"))
    if os.environ.get("DFLASH_BENCH_KEEP") != "1":
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


# --------------------------------------------------------------------------------------- fleet, prompts
def run_params(work: Path, servers: int, profile: dict, **overrides) -> dict:
    from dflash_regen.settings.run_config import DEFAULTS

    return {**DEFAULTS, "model_source_dir": "demo", "staging_dir": str(work / "staged"), "server_command": "emulator",
            "num_servers": servers, "base_port": free_port_block(servers), "ready_timeout_s": 120.0,
            "smoke_timeout_s": 120.0, "output_root": str(work / "out"), "emulator_profile": profile,
            "emulator_faults": {}, **overrides}


@dataclass
class Fleet:
    params: dict
    cfg: object  # RunConfig
    servers: list
    key: str


@contextmanager
def emulated_fleet(work: Path, servers: int, profile: dict, run_id: str = "bench", **overrides):
    """A launched emulated fleet (the launcher's own code path); always stopped afterwards."""
    from dflash_regen.demo.model import write_demo_model
    from dflash_regen.fleet.servers import launch_fleet, read_api_key, stop_fleet
    from dflash_regen.settings.run_config import RunConfig

    params = run_params(work, servers, profile, **overrides)
    cfg = RunConfig.from_params(params, run_id)
    try:
        launched = launch_fleet(cfg.fleet, write_demo_model(work / "model"), cfg.fleet_dir)
        yield Fleet(params, cfg, launched, read_api_key(cfg.fleet_dir))
    finally:
        stop_fleet(cfg.fleet_dir)


def share_fleet(fl: Fleet, run_id: str) -> None:
    """Let another run id's tasks lease this fleet: its fleet dir gets the server records and the API key."""
    from dflash_regen.settings.run_config import RunConfig

    dest = RunConfig.from_params(fl.params, run_id).fleet_dir
    dest.mkdir(parents=True, exist_ok=True)
    for path in [*fl.cfg.layout.fleet.server_specs(), fl.cfg.layout.fleet.api_key]:
        shutil.copy(path, dest)


def prompt_rows(n: int):
    """n demo-mix prompt rows (coding, maths, multi-turn, tools, long notes) with unique ids, streamed."""
    from dflash_regen.demo.prompts import demo_rows

    templates = demo_rows(1000)[:1000]  # without the two malformed demo rows
    for i in range(n):
        yield {**templates[i % len(templates)], "id": f"bench-{i:07d}"}


def write_prompts(path: Path, n: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in prompt_rows(n):
            f.write(json.dumps(row) + "\n")
    return path


def plan(params: dict, run_id: str, source: Path) -> dict:
    from dflash_regen.prompts.planning import plan_shards
    from dflash_regen.settings.run_config import RunConfig

    cfg = RunConfig.from_params({**params, "prompt_source": str(source)}, run_id)
    return plan_shards(source, cfg.layout, cfg.plan)


# -------------------------------------------------------------------------------- measured child processes
def spawn(argv: list[str], log_path: Path) -> subprocess.Popen:
    with log_path.open("wb") as log:  # own session: a kill of its group reaches nothing else
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, start_new_session=True)


def reap(proc: subprocess.Popen, started: float, log_path: Path, *, check: bool = True) -> dict:
    """Wait for the child; its own CPU seconds and peak RSS come from `wait4` (not the sum of all children)."""
    out = proc.stdout.read() if proc.stdout else b""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if check and proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{proc.args} exited {proc.returncode}; stderr ({log_path}):\n{tail}")
    lines = out.decode().strip().splitlines()
    return {"wall_s": round(wall, 3), "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "returncode": proc.returncode,
            "output": json.loads(lines[-1]) if lines and proc.returncode == 0 else None}


def run_measured(argv: list[str], log_path: Path) -> dict:
    started = time.monotonic()
    return reap(spawn(argv, log_path), started, log_path)


def cli_argv(cmd: str, params: dict, run_id: str, *args: str, folder: Path) -> list[str]:
    """argv running this module's CLI command `cmd` (shard, plain, plan) in a child process."""
    path = folder / f"params-{run_id}.json"
    path.write_text(json.dumps(params))
    return [sys.executable, str(BENCH / "benchlib.py"), cmd, str(path), run_id, *args]


# ------------------------------------------------------------------------------------ the two clients
def plain_client(url: str, key: str, rows: list[dict], settings, threads: int = SLOTS) -> dict:
    """What a hand-written script does: one `requests` session, a fixed thread pool, non-streaming requests.

    `rows` hold sample_id, messages and tools as JSON text (a shard file's columns); the request body is the
    one ours sends (same seed), so both clients get the same answers.
    """
    import requests

    from dflash_regen.generate.samples import chat_payload
    from dflash_regen.settings.run_config import sample_seed

    session = requests.Session()

    def send(row: dict) -> int:
        seed = sample_seed(row["sample_id"], settings.seed)
        body = chat_payload(json.loads(row["messages"]), json.loads(row["tools"]) if row["tools"] else None,
                                       settings, seed, settings.sampling.max_tokens)
        resp = session.post(f"{url}/v1/chat/completions", json=body, timeout=3600,
                            headers={"Authorization": f"Bearer {key}"})
        resp.raise_for_status()
        return resp.json()["usage"]["completion_tokens"]

    with ThreadPoolExecutor(threads) as pool:
        tokens = sum(pool.map(send, rows))
    return {"requests": len(rows), "output_tokens": tokens}


def shard_rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["sample_id", "messages", "tools"]).to_pylist()


def _timed(fn) -> dict:
    cpu, wall = time.process_time(), time.perf_counter()
    result = fn()
    return {"work_cpu_s": round(time.process_time() - cpu, 3), "work_wall_s": round(time.perf_counter() - wall, 3),
            "result": result}


def _cli() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    shard = sub.add_parser("shard")
    shard.add_argument("params", type=Path)
    shard.add_argument("run_id")
    shard.add_argument("shard", type=json.loads)
    plain = sub.add_parser("plain")
    plain.add_argument("params", type=Path)
    plain.add_argument("run_id")
    plain.add_argument("shard_file", type=Path)
    plain.add_argument("server", type=int)
    planning = sub.add_parser("plan")
    planning.add_argument("params", type=Path)
    planning.add_argument("run_id")
    planning.add_argument("source", type=Path)
    args = ap.parse_args()
    params = json.loads(args.params.read_text())
    if args.cmd == "shard":
        from dflash_regen import tasks

        out = _timed(lambda: tasks.generate(params, args.run_id, args.shard))
    elif args.cmd == "plan":
        def summary() -> dict:
            got = plan(params, args.run_id, args.source)
            return {"rows": got["rows"], "accepted": got["accepted"], "shards": len(got["shards"]),
                    "first_shard": {**got["shards"][0], "run_prompts": got["accepted"]}}

        out = _timed(summary)
    else:
        from dflash_regen.fleet.servers import load_servers, read_api_key
        from dflash_regen.settings.run_config import RunConfig

        cfg = RunConfig.from_params(params, args.run_id)
        server = load_servers(cfg.fleet_dir)[args.server]
        rows = shard_rows(args.shard_file)
        out = _timed(lambda: plain_client(server.url, read_api_key(cfg.fleet_dir), rows, cfg.generation))
    print(json.dumps(out))


if __name__ == "__main__":
    _cli()
