"""Capacity planner: measure one server, fit throughput vs concurrency, name what binds, predict the run.

- **Measure** (`measure_server`): on one server, stream prompts drawn from the run's own shards (their real
  length mix, with the run's sampling settings and per-sample seeds) at a few concurrency levels up to the slot
  limit, and read SGLang's `/metrics` (`sglang:generation_tokens_total`, `sglang:num_running_reqs`) for the
  aggregate output tok/s and the running batch at each level. The top level runs the whole sample to the end,
  so its output lengths are an unbiased sample of the run's; lower levels are short windows.
- **Fit** (`Curve`): time per output token grows linearly with the running batch, `tpot(b) = a + k*b` (a
  decode step reads the weights once for the batch, then does per-request work), so the aggregate
  `b / (a + k*b)` saturates at `1/k`.
- **Advise** (`advise`): what caps the running batch (client concurrency, KV tokens, Mamba slots, the
  `--max-running-requests` cap) or whether the GPU is already compute-saturated; with SGLang's pool
  arithmetic (Mamba slots and the speculative reserve come out of the KV pool) the largest batch the same
  memory can run, and the exact flags for it.
- **Predict** (`predict`): the whole run's generation wall time and GPU-hours. Each shard is simulated (`c`
  requests in flight, each decoding at the curve's rate for the current batch, so a shard's drain is counted)
  and the shards are spread over the servers as the mapped tasks take them; the 80% interval comes from the
  fit's covariance and a bootstrap of the length sample.

The report is `<run>/reports/capacity.json` (`plan_report`), re-plannable for another run size from the
stored measurement (`python -m dflash_regen.capacity plan`).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import logging
import math
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from dflash_regen import atomic
from dflash_regen.config import GenerationSettings
from dflash_regen.errors import Cancelled, CapacityError, MetricsMissing, PromptError, TooFewPrompts, TransientError
from dflash_regen.fleet import Server
from dflash_regen.generation import chat_payload, sample_seed
from dflash_regen.sglang import (
    Api,
    ChatResult,
    make_session,
    reasoning_tokens,
    with_retries,
)

log = logging.getLogger(__name__)

REPORT = "capacity.json"
SCHEMA_VERSION = 1
SAMPLE_EVERY_S = 0.1
WARMUP_S = 5.0
MIN_WINDOW_S, MAX_WINDOW_S = 1.0, 30.0
COMPUTE_GAIN = 0.10  # doubling the batch adds less than this: the GPU, not a setting, is the limit
KV_HEADROOM = 1.25  # KV tokens per request of mean size the advised batch must keep (SGLang retracts when full)
GRAPH_BATCH = 8  # SGLang captures CUDA graphs at batch sizes in steps of 8: advise a multiple of it
INTERVAL = (10, 90)  # percentiles of the reported interval


# ------------------------------------------------------------------------------------------------ the curve
@dataclass(frozen=True)
class Curve:
    """Aggregate decode throughput vs running batch: each request takes `a + k*b` seconds per token."""

    a: float
    k: float
    cov: tuple[tuple[float, float], tuple[float, float]] = ((0.0, 0.0), (0.0, 0.0))
    measured_up_to: int = 1

    def per_request(self, batch: float) -> float:
        return 1.0 / (self.a + self.k * batch)

    def aggregate(self, batch: float) -> float:
        return batch / (self.a + self.k * batch)

    @property
    def saturation(self) -> float | None:
        return 1.0 / self.k if self.k > 0 else None

    @classmethod
    def fit(cls, levels: list[dict]) -> Curve:
        """Least squares of tpot = running / tok_s on the running batch; k >= 0 (throughput never falls)."""
        b = np.array([lv["running"] for lv in levels], float)
        tpot = b / np.array([lv["tok_s"] for lv in levels], float)
        up_to = int(round(b.max()))
        if len(set(np.round(b, 3))) < 2:
            return cls(a=float(tpot.mean()), k=0.0, measured_up_to=up_to)
        x = np.column_stack([np.ones_like(b), b])
        coef, *_ = np.linalg.lstsq(x, tpot, rcond=None)
        a, k = float(coef[0]), float(coef[1])
        if k * b.max() < 0.01 * a:  # per-token time flat within 1% up to the slot limit: no measurable ceiling
            return cls(a=float(tpot.mean()), k=0.0, measured_up_to=up_to)
        dof = len(b) - 2
        sigma2 = float(((x @ coef - tpot) ** 2).sum() / dof) if dof > 0 else 0.0
        cov = sigma2 * np.linalg.inv(x.T @ x)
        return cls(a=a, k=k, cov=tuple(map(tuple, cov.tolist())), measured_up_to=up_to)

    def to_dict(self) -> dict:
        return {"tpot_a_s": self.a, "tpot_k_s": self.k, "cov": [list(r) for r in self.cov],
                "single_request_tok_s": round(self.per_request(1), 1),
                "saturation_tok_s": round(self.saturation, 1) if self.saturation else None,
                "measured_up_to": self.measured_up_to}

    @classmethod
    def from_dict(cls, d: dict) -> Curve:
        return cls(a=d["tpot_a_s"], k=d["tpot_k_s"], cov=tuple(map(tuple, d["cov"])),
                   measured_up_to=d["measured_up_to"])


# ---------------------------------------------------------------------------------------------- measuring
def read_metrics(api: Api) -> tuple[float, float]:
    """(generation tokens so far, running requests now) from SGLang's Prometheus endpoint."""
    try:
        found = api.metrics()
    except MetricsMissing as exc:
        raise CapacityError(f"{exc}: calibration reads SGLang's token counter, so launch with --enable-metrics "
                            "(a cookbook default: drop '--enable-metrics off' from server_flags), or set Param "
                            "calibration_prompts to 0 to skip calibration") from exc
    except TransientError as exc:
        raise CapacityError(str(exc)) from exc
    if "generation_tokens_total" not in found:
        raise CapacityError(f"{api.url}/metrics has no sglang:generation_tokens_total; is this SGLang >= 0.5.10?")
    return found["generation_tokens_total"], found.get("num_running_reqs", float("nan"))


def sample_prompts(shards: list[dict], k: int, seed: int) -> list[dict]:
    """k prompts drawn at random from all shards (so the sample has the run's length mix), in random order."""
    rng = np.random.default_rng(seed)
    sizes = np.array([s["prompts"] for s in shards], float)
    if not sizes.sum():
        raise CapacityError("the plan has no prompts to calibrate with")
    picks = rng.choice(int(sizes.sum()), size=min(k, int(sizes.sum())), replace=False)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    chosen: list[dict] = []
    for i, shard in enumerate(shards):
        rows = sorted(int(p - starts[i]) for p in picks if starts[i] <= p < starts[i] + sizes[i])
        if rows:
            table = pq.read_table(shard["path"], columns=["sample_id", "messages", "tools"])
            chosen += [table.slice(r, 1).to_pylist()[0] for r in rows]
    order = rng.permutation(len(chosen))
    return [chosen[i] for i in order]


def levels_for(slots: int) -> list[int]:
    """Concurrency levels to measure: 1, a quarter, a half and all of the slots."""
    return sorted({max(1, slots // 4), max(1, slots // 2), slots, 1})


class _Level:
    """Keep `concurrency` streams busy over `prompts`; sample /metrics while they run."""

    def __init__(self, server: Server, api_key: str, settings: GenerationSettings, prompts: list[dict],
                 concurrency: int, cycle: bool):
        self.server, self.api_key, self.settings = server, api_key, settings
        self.concurrency = concurrency
        self.session = make_session(concurrency + 1)
        self.api = Api(server.url, api_key, session=self.session)
        self._prompts = itertools.cycle(prompts) if cycle else iter(prompts)
        self._lock = threading.Lock()
        self.stop = threading.Event()
        self.drained = threading.Event()  # the last prompt has been sent
        self.results: list[ChatResult] = []
        self.errors: list[BaseException] = []

    def _next(self) -> dict | None:
        with self._lock:
            row = next(self._prompts, None)
            if row is None:
                self.drained.set()
            return row

    def _worker(self) -> None:
        while not self.stop.is_set() and (row := self._next()) is not None:
            messages = json.loads(row["messages"])
            tools = json.loads(row["tools"]) if row["tools"] else None
            payload = chat_payload(messages, tools, self.settings, sample_seed(row["sample_id"], self.settings.seed),
                                   self.settings.sampling.max_tokens)
            try:
                result = with_retries(lambda p=payload: self.api.stream(p, stall_s=self.settings.stall_s,
                                                                        cap_s=self.settings.request_cap_s,
                                                                        stop=self.stop),
                                      self.settings.request_retries + 1, max_delay_s=10.0)
            except Cancelled:
                return
            except PromptError:
                continue  # the prompt's fault (planning would quarantine it in generate): measure the others
            except TransientError as exc:
                self.errors.append(exc)
                self.stop.set()
                return
            with self._lock:
                self.results.append(result)

    def run(self, window_s: float | None, cap_s: float | None = None) -> dict:
        """One level: warm up until the server runs the whole batch (at most `WARMUP_S`), then measure.

        With `window_s` the level is measured for that long and cut; without it the prompts run out
        and the measurement ends when the last one is sent (the drain that follows is not steady state),
        or after `cap_s` at most (the rest is cut: a time-bounded measurement).
        """
        if cap_s is not None and window_s is None:
            timer = threading.Timer(cap_s, self.drained.set)  # as if the prompts had run out
            timer.daemon = True
            timer.start()
        threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(self.concurrency)]
        tokens_start = read_metrics(self.api)[0]
        started = time.monotonic()
        for t in threads:
            t.start()
        # While the batch fills (prefills) the rate is not this level's. A KV-bound server never fills it, and a
        # very fast one may finish before a sample sees it full: then the level is measured from its start.
        fill_s = None
        while not self.stop.is_set() and not (window_s is None and self.drained.is_set()) \
                and time.monotonic() - started < WARMUP_S:
            if read_metrics(self.api)[1] >= self.concurrency:
                fill_s = time.monotonic() - started
                break
            time.sleep(SAMPLE_EVERY_S)
        t0, tokens0 = started, tokens_start
        if fill_s is not None:
            t0, tokens0 = time.monotonic(), read_metrics(self.api)[0]
        running: list[float] = []
        while not self.stop.is_set():
            time.sleep(SAMPLE_EVERY_S)
            running.append(read_metrics(self.api)[1])
            if (window_s and time.monotonic() - t0 >= window_s) or (not window_s and self.drained.is_set()):
                break
        t1, tokens1 = time.monotonic(), read_metrics(self.api)[0]
        if window_s or cap_s is not None:
            self.stop.set()
        for t in threads:
            t.join()
        if self.errors:
            raise CapacityError(f"calibration on {self.server.name} at concurrency {self.concurrency} failed: "
                                f"{self.errors[0]}; check the server log {self.server.log_path}")
        seconds = t1 - t0
        measured = [r for r in running if not math.isnan(r)]
        if seconds <= 0 or tokens1 <= tokens0:
            raise CapacityError(f"{self.server.name} produced no tokens in {seconds:.1f} s at concurrency "
                                f"{self.concurrency}; is it wedged? log: {self.server.log_path}")
        return {"concurrency": self.concurrency,
                "running": round(float(np.mean(measured)) if measured else float(self.concurrency), 2),
                "seconds": round(seconds, 2), "output_tokens": int(tokens1 - tokens0),
                "tok_s": round((tokens1 - tokens0) / seconds, 1), "total_s": round(time.monotonic() - started, 2),
                "fill_s": round(fill_s, 2) if fill_s is not None else None}


def measure_server(server: Server, api_key: str, settings: GenerationSettings, prompts: list[dict],
                   slots: int, budget_s: float | None = None) -> dict:
    """Measure output tok/s at each of `levels_for(slots)` on one server; returns the calibration record.

    With `budget_s` the whole measurement takes about that long at most: the full-slot level is cut at 70% of
    it (its output lengths are then the answers that finished, biased short) and the windows share the rest.
    """
    if not prompts:
        raise CapacityError("no prompts to calibrate with")
    started = time.monotonic()
    levels = levels_for(slots)
    log.info("calibrating %s: %d prompts from the run's shards, concurrency %s", server.name, len(prompts),
             "/".join(map(str, levels)))
    top = _Level(server, api_key, settings, prompts, slots, cycle=False)
    measured = [top.run(window_s=None, cap_s=0.7 * budget_s if budget_s else None)]
    lengths = [r.usage.get("completion_tokens") or 0 for r in top.results]
    prompt_tokens = [r.usage.get("prompt_tokens") or 0 for r in top.results]
    reasoning = [reasoning_tokens(r.usage) for r in top.results]
    finish: dict[str, int] = {}
    for r in top.results:
        finish[r.finish_reason or "none"] = finish.get(r.finish_reason or "none", 0) + 1
    # Lower levels only need the rate: short windows, a tenth of the full-sample run each.
    window = min(max(0.1 * measured[0]["total_s"], MIN_WINDOW_S), MAX_WINDOW_S)
    if budget_s:
        window = min(window, max(0.1 * budget_s, MIN_WINDOW_S / 2))
    for c in reversed(levels[:-1]):
        measured.append(_Level(server, api_key, settings, prompts, c, cycle=True).run(window_s=window))
    measured.sort(key=lambda lv: lv["concurrency"])
    for lv in measured:
        log.info("  concurrency %3d: %6.1f running, %8.1f output tok/s over %.1f s", lv["concurrency"],
                 lv["running"], lv["tok_s"], lv["seconds"])
    return {"server": server.name, "url": server.url, "slots": slots, "prompts": len(prompts),
            # From a standing start the batch fills request by request (tokenize, prefill): a shard pays it once.
            "fill_s": measured[-1]["fill_s"] or 0.0,
            "seconds": round(time.monotonic() - started, 1), "levels": measured,
            "output_tokens": lengths, "prompt_tokens": prompt_tokens, "reasoning_tokens": reasoning,
            "finish_reasons": finish,
            "max_tokens": settings.sampling.max_tokens}


# ------------------------------------------------------------------------------------------------ memory
@dataclass(frozen=True)
class Memory:
    """One server's allocation (health_check's figures) and what other Mamba settings would leave for KV."""

    server: str
    kv_tokens: int
    running_slots: int
    max_running_requests: int | None  # the server-args value (sizes the speculative reserve)
    mamba_slots: int | None
    mamba_ratio: int | None
    kv_gb: float | None
    mamba_gb: float | None
    reserve_gb: float | None

    @classmethod
    def from_health(cls, entry: dict) -> Memory:
        alloc, figures = entry.get("allocation") or {}, entry.get("log_figures") or {}
        slots, mamba = alloc["running_slots"], alloc.get("mamba_slots")
        ratio = None
        if mamba:
            # SGLang: 1 without radix cache, else 3, +2 for extra_buffer with overlap (spec v2), +1 without or lazy.
            ratio = 1 if not alloc.get("radix_cache", True) else 3
            if alloc.get("radix_cache", True) and alloc.get("mamba_strategy") == "extra_buffer":
                ratio += 1 if mamba // 4 == slots and mamba // 5 != slots else 2
            elif alloc.get("radix_cache", True) and alloc.get("mamba_strategy") == "extra_buffer_lazy":
                ratio += 1  # the second tracking slot is deferred
            ratio = figures.get("mamba_ratio") or ratio  # 0.5.18+ logs it
        return cls(server=entry.get("server", ""), kv_tokens=alloc["kv_tokens"], running_slots=slots,
                   max_running_requests=alloc.get("max_running_requests"), mamba_slots=mamba, mamba_ratio=ratio,
                   kv_gb=alloc.get("kv_cache_gb") or figures.get("kv_cache_gb"), mamba_gb=figures.get("mamba_gb"),
                   reserve_gb=figures.get("mamba_reserve_gb"))

    @property
    def knows_pools(self) -> bool:
        return bool(self.kv_gb and self.mamba_gb and self.mamba_slots and self.mamba_ratio
                    and self.reserve_gb is not None and self.kv_tokens)

    def kv_tokens_at(self, running: int, speculative: bool = True) -> int | None:
        """KV tokens with `--max-mamba-cache-size running*ratio --max-running-requests running`, same memory
        (without MTP, `speculative=False`, the draft's reserve goes to the pool too)."""
        if not self.knows_pools:
            return None
        pool = self.kv_gb + self.mamba_gb + self.reserve_gb
        reserve_per_request = self.reserve_gb / (self.max_running_requests or self.running_slots) if speculative \
            else 0.0
        left = pool - running * self.mamba_ratio * self.mamba_gb / self.mamba_slots - running * reserve_per_request
        return max(int(left / (self.kv_gb / self.kv_tokens)), 0)

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------------------ advice
@dataclass(frozen=True)
class RunShape:
    """The run to predict: how many prompts, on how many servers, in which shards, with which client."""

    prompts: int
    servers: int
    shard_size: int
    concurrency_per_server: int = 0  # 0 = the server's slots (the generate default)
    mean_output_tokens: float | None = None  # rescale the measured lengths to this mean (planning another run)


def _kv_fit(kv_tokens: int, request_tokens: float) -> int:
    return int(kv_tokens // max(request_tokens, 1))


def running_batch(mem: Memory, shape: RunShape, request_tokens: float) -> tuple[int, str]:
    """(requests a server actually runs at once, what caps it)."""
    client = shape.concurrency_per_server or mem.running_slots
    kv_fit = _kv_fit(mem.kv_tokens, request_tokens)
    if client < mem.running_slots and client <= kv_fit:
        return client, "client concurrency"
    if kv_fit < mem.running_slots:
        return max(kv_fit, 1), "KV tokens"
    mamba_capped = bool(mem.mamba_slots and mem.mamba_ratio and mem.running_slots == mem.mamba_slots // mem.mamba_ratio
                        and (mem.max_running_requests is None or mem.running_slots < mem.max_running_requests))
    return mem.running_slots, "Mamba slots" if mamba_capped else "running requests"


def client_concurrency(running: int) -> int:
    """In flight per server: the slots plus a small queue, so a slot never waits for the client's next request."""
    return running + max(1, math.ceil(running / 8))


def advise(curve: Curve, mems: list[Memory], shape: RunShape, request_tokens: float) -> dict:
    """The binding resource on the calibrated server (`mems[0]`) and the fleet-wide settings that lift it."""
    mem = mems[0]
    running, capped_by = running_batch(mem, shape, request_tokens)
    kv_fit = _kv_fit(mem.kv_tokens, request_tokens)
    gain = curve.aggregate(2 * running) / curve.aggregate(running) - 1
    details = {
        "client concurrency": f"the client keeps {running} requests in flight per server but the server has "
                              f"{mem.running_slots} slots: set concurrency_per_server",
        "KV tokens": f"the KV cache ({mem.kv_tokens:,} tokens) holds {kv_fit} requests of ~{request_tokens:,.0f} "
                     f"tokens, fewer than the {mem.running_slots} slots",
        "Mamba slots": f"{mem.mamba_slots} Mamba slots // {mem.mamba_ratio} = {mem.running_slots} running requests, "
                       f"while the KV cache could hold {kv_fit} requests of ~{request_tokens:,.0f} tokens",
        "running requests": f"--max-running-requests caps the server at {mem.running_slots} running requests "
                            f"(the KV cache could hold {kv_fit})",
    }
    binding, detail = capped_by, details[capped_by]
    if gain < COMPUTE_GAIN:
        binding, detail = "compute", (f"the GPU is saturated: {running} running requests give "
                                      f"{curve.aggregate(running):,.0f} tok/s and twice as many would add only "
                                      f"{gain:.0%} ({details[capped_by]})")
    target, flags, notes = mem.running_slots, [], []
    if binding != "compute":
        if all(m.knows_pools for m in mems):
            fits = [n for n in range(1, 4097)
                    if all(m.kv_tokens_at(n) >= KV_HEADROOM * n * request_tokens for m in mems)]
            best = max(fits, default=1)
            target = best // GRAPH_BATCH * GRAPH_BATCH if best >= GRAPH_BATCH else best
            notes.append(f"in the same memory, up to {best} running requests leave KV for {KV_HEADROOM:g}x their "
                         f"tokens once Mamba slots and the speculative reserve are taken (advised: {target}, "
                         "a CUDA-graph batch size)")
        else:
            target = min(2 * mem.running_slots, kv_fit)
            notes.append("the startup logs give no Mamba memory figures, so the KV tokens left after a change are "
                         "not known: check health_check's table after relaunching")
        if binding != "KV tokens":
            target = max(target, mem.running_slots)  # only KV pressure is a reason to run fewer
        # An explicit --max-running-requests also shrinks the speculative reserve, which is sized by it.
        if target != mem.running_slots or (mem.max_running_requests or target) != target:
            if mem.mamba_slots and mem.mamba_ratio and mem.mamba_slots // mem.mamba_ratio != target:
                flags += ["--max-mamba-cache-size", str(target * mem.mamba_ratio)]
            flags += ["--max-running-requests", str(target)]
        if binding == "KV tokens":
            notes.append("if another process holds GPU memory, free it; else raise --mem-fraction-static")
    advised = target if flags else running
    return {"resource": binding, "detail": detail, "running_now": running, "gain_if_doubled": round(gain, 3),
            "server_flags": " ".join(flags), "running_advised": advised,
            "kv_tokens_advised": mem.kv_tokens_at(target) if flags and mem.knows_pools else mem.kv_tokens,
            "concurrency_per_server": client_concurrency(min(mem.running_slots, max(kv_fit, 1))),
            "concurrency_per_server_advised": client_concurrency(advised), "notes": notes}


# -------------------------------------------------------------------------------------------- prediction
def simulate_shard(lengths: np.ndarray, concurrency: int, curve: Curve) -> float:
    """Seconds to finish these outputs (tokens, in send order) with `concurrency` in flight.

    Every running request decodes at the curve's per-request rate for the current batch, so the drain at
    the end (fewer requests, each faster) is counted.
    """
    t, i, n = 0.0, 0, len(lengths)
    running = np.empty(0)
    while i < n or running.size:
        if running.size < concurrency and i < n:
            take = min(concurrency - running.size, n - i)
            running = np.concatenate([running, lengths[i:i + take]])
            i += take
        rate = curve.per_request(running.size)
        dt = float(running.min()) / rate
        t += dt
        running = running - dt * rate
        running = running[running > 1e-6]
    return t


def makespan(durations: list[float], factors: list[float]) -> float:
    """Shards in order, each to the server that frees up first (as the mapped tasks lease them); a shard takes
    `factors[i]` times its duration on server i."""
    free = [(0.0, i) for i in range(len(factors))]
    heapq.heapify(free)
    end = 0.0
    for d in durations:
        at, i = heapq.heappop(free)
        done = at + d * factors[i]
        end = max(end, done)
        heapq.heappush(free, (done, i))
    return end


def predict(curve: Curve, lengths: np.ndarray, shape: RunShape, running: list[int], *, fill_s: float = 0.0,
            seed: int = 0, reps: int = 16, draws: int = 200) -> dict:
    """Wall time and GPU-hours of generating the run with `running[i]` requests at once on server i.

    Each draw spreads shards whose durations are drawn from simulated shards (plus `fill_s`, the measured
    time a server takes to fill its batch from a standing start), so a server that happens to get the long
    shards is counted, with the curve drawn from the fit's covariance and the mean output
    length from a bootstrap of the sample: the mean is the prediction, the percentiles its interval.
    """
    rng = np.random.default_rng(seed)
    sizes = [shape.shard_size] * (shape.prompts // shape.shard_size)
    if shape.prompts % shape.shard_size:
        sizes.append(shape.prompts % shape.shard_size)
    ref = max(set(running), key=running.count)
    simulated = {size: fill_s + np.array([simulate_shard(rng.choice(lengths, size), ref, curve)
                                          for _ in range(reps)]) for size in set(sizes)}
    # Other batch sizes (a server with fewer slots or less KV) scale with the aggregate rate.
    factors = [curve.aggregate(ref) / curve.aggregate(r) for r in running]
    picks = {size: rng.choice(simulated[size], size=(draws, sizes.count(size))) for size in simulated}
    walls = np.empty(draws)
    for d in range(draws):
        taken = {size: iter(picks[size][d]) for size in picks}
        walls[d] = makespan([next(taken[size]) for size in sizes], factors)
    a_k = rng.multivariate_normal([curve.a, curve.k], np.array(curve.cov), size=draws, method="eigh")
    a_k = np.clip(a_k, [curve.a * 0.05, 0.0], None)
    rate_ratio = curve.aggregate(ref) / (ref / (a_k[:, 0] + a_k[:, 1] * ref))
    boot = rng.choice(lengths, size=(draws, len(lengths))).mean(axis=1) / lengths.mean()
    wall = float(walls.mean())
    lo, hi = (float(x) for x in np.percentile(walls * rate_ratio * boot, INTERVAL))
    servers = len(running)
    return {"running_per_server": ref, "tok_s_per_server": round(curve.aggregate(ref), 1),
            "fleet_tok_s": round(sum(curve.aggregate(r) for r in running), 1),
            "wall_s": round(wall, 1), "wall_s_interval": [round(lo, 1), round(hi, 1)],
            "gpu_hours": round(wall * servers / 3600, 2),
            "gpu_hours_interval": [round(lo * servers / 3600, 2), round(hi * servers / 3600, 2)],
            "requests_per_s_per_server": round(curve.aggregate(ref) / float(lengths.mean()), 4),
            "extrapolated": ref > curve.measured_up_to}


def memories(health: dict, calibrated_url: str) -> list[Memory]:
    """Every healthy server's allocation from health_check's report, the calibrated server first."""
    entries = [s for s in health["servers"] if s.get("healthy") and s.get("allocation")]
    entries.sort(key=lambda s: s.get("url") != calibrated_url)
    if not entries:
        raise CapacityError("the health report lists no healthy server with an allocation; run health_check first")
    return [Memory.from_health(e) for e in entries]


def train_length_budget(calibration: dict, train_max_length: int, scale: float = 1.0) -> dict | None:
    """What cutting each answer at `train_max_length - its prompt tokens` (what the trainer reads) saves and costs,
    from the calibration's sample (output lengths rescaled by `scale` like the prediction's)."""
    pairs = [(o * scale, p, (r or 0) * scale) for o, p, r in zip(
        calibration["output_tokens"], calibration["prompt_tokens"],
        calibration.get("reasoning_tokens") or [0] * len(calibration["output_tokens"]), strict=False) if o > 0]
    if not train_max_length or not pairs:
        return None
    out = np.array([o for o, _, _ in pairs])
    room = np.array([max(train_max_length - p, 1) for _, p, _ in pairs], float)
    reasoning = np.array([r for _, _, r in pairs])
    cut = out > room
    return {"train_max_length": train_max_length, "samples": len(pairs),
            "tokens_past_share": round(float(np.maximum(out - room, 0).sum() / out.sum()), 4),
            "samples_cut_share": round(float(cut.mean()), 4),
            # cut before the thinking ended: the sample keeps no answer, only reasoning
            "reasoning_only_share": round(float((cut & (reasoning >= room)).mean()), 4),
            "lengths": np.minimum(out, room)}


def plan_report(calibration: dict, mems: list[Memory], shape: RunShape, *, server_flags: str = "",
                seed: int = 0, train_max_length: int = 0) -> dict:
    """The full capacity report (`capacity.json`) from a measurement and health_check's figures."""
    curve = Curve.fit(calibration["levels"])
    lengths = np.array([x for x in calibration["output_tokens"] if x > 0], float)
    if not lengths.size:
        raise CapacityError("the calibration produced no finished answers; nothing to size the run with")
    scale = shape.mean_output_tokens / lengths.mean() if shape.mean_output_tokens else 1.0
    lengths = lengths * scale
    prompt_mean = float(np.mean(calibration["prompt_tokens"])) if calibration["prompt_tokens"] else 0.0
    request_tokens = prompt_mean + float(lengths.mean())
    measured = mems
    mems = (mems * shape.servers)[:shape.servers]  # planning a bigger fleet: more of the same servers
    advice = advise(curve, mems, shape, request_tokens)
    fill_s = calibration.get("fill_s", 0.0)
    current = predict(curve, lengths, shape, [running_batch(m, shape, request_tokens)[0] for m in mems],
                      fill_s=fill_s, seed=seed)
    scenarios = [{"name": "current", "server_flags": server_flags,
                  "concurrency_per_server": shape.concurrency_per_server or mems[0].running_slots, **current}]
    if advice["server_flags"] or advice["running_advised"] != advice["running_now"]:
        n = advice["running_advised"]
        advised = predict(curve, lengths, shape, [n] * len(mems), fill_s=fill_s * n / advice["running_now"],
                          seed=seed)
        flags = " ".join(x for x in (server_flags, advice["server_flags"]) if x)
        scenarios.append({"name": "advised", "server_flags": flags,
                          "concurrency_per_server": advice["concurrency_per_server_advised"], **advised})
    budget = train_length_budget(calibration, train_max_length, scale)
    if budget:
        clipped = budget.pop("lengths")
        at_budget = predict(curve, clipped, shape, [running_batch(m, shape, prompt_mean + float(clipped.mean()))[0]
                                                    for m in mems], fill_s=fill_s, seed=seed)
        scenarios.append({"name": "train-length budget", "server_flags": server_flags,
                          "concurrency_per_server": scenarios[0]["concurrency_per_server"], **at_budget})
        budget["saving_share"] = round(1 - at_budget["wall_s"] / current["wall_s"], 4)
    return {"version": SCHEMA_VERSION, "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "calibration": calibration, "curve": curve.to_dict(),
            "allocation": [m.to_dict() for m in measured],
            "run": {**asdict(shape), "mean_output_tokens": round(float(lengths.mean()), 1),
                    "mean_prompt_tokens": round(prompt_mean, 1),
                    "output_tokens_total": int(shape.prompts * lengths.mean())},
            "binding": {"resource": advice["resource"], "detail": advice["detail"]},
            "advice": advice, "scenarios": scenarios, "table": table_rows(scenarios), "budget": budget}


# ------------------------------------------------------------------------------------------------ output
def _hours(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h" if seconds >= 3600 else f"{seconds:,.1f} s"


def table_rows(scenarios: list[dict]) -> list[dict]:
    """One row per scenario, columns named for people (the table the task logs and the fleet page shows)."""
    rows = []
    for sc in scenarios:
        lo, hi = sc["wall_s_interval"]
        glo, ghi = sc["gpu_hours_interval"]
        rows.append({"settings": f"{sc['name']}: {sc['server_flags'] or 'cookbook flags'}",
                     "running / server": f"{sc['running_per_server']}{' *' if sc['extrapolated'] else ''}",
                     "in flight / server": str(sc["concurrency_per_server"]),
                     "tok/s / server": f"{sc['tok_s_per_server']:,.0f}", "fleet tok/s": f"{sc['fleet_tok_s']:,.0f}",
                     "generation wall time (80% interval)": f"{_hours(sc['wall_s'])} ({_hours(lo)} - {_hours(hi)})",
                     "GPU-hours (80% interval)": f"{sc['gpu_hours']:,.1f} ({glo:,.1f} - {ghi:,.1f})"})
    return rows


def format_table(report: dict) -> str:
    """The planner's answer as a few lines and a markdown table (logged by the task, printed by the CLI)."""
    run, cal, curve, advice = report["run"], report["calibration"], report["curve"], report["advice"]
    levels = ", ".join(f"{lv['tok_s']:,.0f} at {lv['running']:g}" for lv in cal["levels"])
    ceiling = f"{curve['saturation_tok_s']:,.0f} tok/s" if curve["saturation_tok_s"] else "none measurable"
    lines = [
        f"run: {run['prompts']:,} prompts x {run['mean_output_tokens']:,.0f} mean output tokens "
        f"({run['output_tokens_total'] / 1e6:,.1f}M tokens) on {run['servers']} servers, shards of "
        f"{run['shard_size']:,}",
        f"measured on {cal['server']}, {cal['prompts']} prompts from the run's shards, {cal['seconds']:.0f} s: "
        f"output tok/s {levels} running; fit: {curve['single_request_tok_s']:,.0f} tok/s alone, ceiling {ceiling}",
        f"binding: {advice['resource']}: {advice['detail']}",
    ]
    if advice["server_flags"]:
        lines.append(f"advice: relaunch with server_flags '{advice['server_flags']}' and concurrency_per_server "
                     f"{advice['concurrency_per_server_advised']}")
    lines.append(f"client: concurrency_per_server {advice['concurrency_per_server']} suits the current servers "
                 "(Param apply_advised_concurrency applies it)")
    lines += [f"note: {n}" for n in advice["notes"]]
    if b := report.get("budget"):
        lines.append(f"train-length budget (max_tokens = {b['train_max_length']:,} - prompt tokens, what the trainer "
                     f"reads): {b['tokens_past_share']:.1%} of output tokens lie past it; it saves "
                     f"{b['saving_share']:.1%} of the generation time and cuts {b['samples_cut_share']:.1%} of the "
                     f"samples ({b['reasoning_only_share']:.1%} left reasoning-only); Param budget = train_length")
    rows = [list(report["table"][0])] + [list(row.values()) for row in report["table"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    table.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += [""] + table
    if any(sc["extrapolated"] for sc in report["scenarios"]):
        lines.append(f"\\* beyond the largest measured batch ({curve['measured_up_to']}): the fitted curve is "
                     "extrapolated")
    return "\n".join(lines)


def read_report(reports_dir: Path) -> dict | None:
    path = reports_dir / REPORT
    return json.loads(path.read_text()) if path.is_file() else None


def calibrate(server: Server, api_key: str, health: dict, shards: list[dict], settings: GenerationSettings,
              shape: RunShape, *, prompts: int, server_flags: str = "", train_max_length: int = 0) -> dict:
    """Measure `server` with `prompts` prompts of the run's shards and plan the run: the capacity report."""
    entry = next((s for s in health["servers"] if s.get("url") == server.url and s.get("allocation")), None)
    if entry is None:
        raise CapacityError(f"health report has no allocation for {server.name}; run health_check first")
    slots = entry["allocation"]["running_slots"]
    sample = sample_prompts(shards, max(prompts, 2 * slots), settings.seed)
    if len(sample) < 2 * slots:
        raise TooFewPrompts(f"calibration needs at least {2 * slots} prompts (twice the {slots} slots) to reach a "
                            f"steady state, the run has {len(sample)}; set Param calibration_prompts to 0 to skip it")
    calibration = measure_server(server, api_key, settings, sample, slots)
    return plan_report(calibration, memories(health, server.url), shape, server_flags=server_flags,
                       seed=settings.seed, train_max_length=train_max_length)


# ---------------------------------------------------------------------------------------------------- CLI
def _shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, help="prompts in the run (default: the planned or measured run)")
    p.add_argument("--servers", type=int, help="servers in the fleet (default: the run's)")
    p.add_argument("--shard-size", type=int, help="prompts per shard (default: the run's)")
    p.add_argument("--mean-output-tokens", type=float, help="rescale the measured output lengths to this mean")
    p.add_argument("--concurrency-per-server", type=int, help="client requests in flight per server (0 = slots)")
    p.add_argument("--train-max-length", type=int, default=4096,
                   help="the trainer's max_length: report what a train-length budget saves (0 = not)")
    p.add_argument("--json", type=Path, help="also write the report here")


def _shape(ns, default: RunShape) -> RunShape:
    return RunShape(prompts=ns.prompts or default.prompts, servers=ns.servers or default.servers,
                    shard_size=ns.shard_size or default.shard_size,
                    concurrency_per_server=(default.concurrency_per_server if ns.concurrency_per_server is None
                                            else ns.concurrency_per_server),
                    mean_output_tokens=ns.mean_output_tokens or default.mean_output_tokens)


def _emulate(ns) -> dict:
    """Launch one emulated server with the DAG's launcher, gate it, plan the prompts, calibrate, stop it."""
    from dflash_regen import fleet, planning, probes
    from dflash_regen.config import DEFAULTS, DEMO_PROMPTS, RunConfig
    from dflash_regen.demo_model import write_demo_model
    from dflash_regen.demo_prompts import write_demo_prompts

    with tempfile.TemporaryDirectory(prefix="dflash-capacity-") as tmp:
        root = Path(tmp)
        params = {**DEFAULTS, "server_command": "emulator", "num_servers": 1, "output_root": str(root),
                  "server_flags": ns.server_flags, "emulator_profile": json.loads(ns.profile),
                  "base_port": ns.port, "prompt_source": ns.prompt_source, "min_kv_tokens": 0,
                  "min_running_requests": 1, "staging_dir": str(root / "model")}
        cfg = RunConfig.from_params(params, "capacity")
        model = write_demo_model(root / "model")
        source = Path(ns.prompt_source) if ns.prompt_source != DEMO_PROMPTS else write_demo_prompts(
            root / "prompts.jsonl")
        plan = planning.plan_shards(source, cfg.run_dir / "shards", cfg.run_dir / "failures" / "plan.parquet",
                                    replace(cfg.plan, max_bad_share=1.0))
        servers = fleet.launch_fleet(cfg.fleet, model, cfg.fleet_dir)
        try:
            key = fleet.read_api_key(cfg.fleet_dir)
            health = probes.health_gate(servers, key, cfg.fleet)
            shape = _shape(ns, RunShape(plan["accepted"], 1, cfg.plan.shard_size, cfg.generation.in_flight))
            return calibrate(servers[0], key, health, plan["shards"], cfg.generation, shape,
                             prompts=ns.calibration_prompts, server_flags=ns.server_flags,
                             train_max_length=ns.train_max_length)
        finally:
            fleet.stop_fleet(cfg.fleet_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_regen.capacity", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    em = sub.add_parser("emulate", help="launch one emulated SGLang server, measure it on the prompts, plan the run")
    em.add_argument("--profile", default='{"preset": "qwen3.6-27b-b200-mtp"}', help="emulator profile (JSON)")
    em.add_argument("--server-flags", default="", help="SGLang flags on top of the cookbook's")
    em.add_argument("--prompt-source", default="demo", help="prompts to sample from (file, directory or 'demo')")
    em.add_argument("--calibration-prompts", type=int, default=64)
    em.add_argument("--port", type=int, default=31000)
    _shape_args(em)
    pl = sub.add_parser("plan", help="re-plan from a stored capacity.json (another run size or fleet)")
    pl.add_argument("report", type=Path)
    _shape_args(pl)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)  # the measurement's progress; the table is printed below
    if ns.command == "emulate":
        report = _emulate(ns)
    else:
        stored = json.loads(ns.report.read_text())
        run = stored["run"]
        default = RunShape(run["prompts"], run["servers"], run["shard_size"], run["concurrency_per_server"],
                           run["mean_output_tokens"])
        report = plan_report(stored["calibration"], [Memory(**m) for m in stored["allocation"]],
                             _shape(ns, default), server_flags=stored["scenarios"][0]["server_flags"],
                             train_max_length=ns.train_max_length)
    print(format_table(report))
    if ns.json:
        atomic.write_json(ns.json, report)
    return 0


if __name__ == "__main__":
    from dflash_regen.capacity import main as _main  # one module object, so its logger is dflash_regen.capacity

    sys.exit(_main())
