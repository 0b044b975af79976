"""Measure one server: stream prompts drawn from the run's shards at a few concurrency levels and read SGLang's
`/metrics` for the output tok/s and the running batch at each (the calibration record `plan_report` fits)."""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from dflash_regen.errors import Cancelled, CapacityError, MetricsMissing, PromptError, TransientError
from dflash_regen.fleet.servers import Server
from dflash_regen.settings.run_config import GenerationSettings, sample_seed
from dflash_regen.sglang.api import Api, ChatResult, chat_payload, reasoning_tokens, with_retries

log = logging.getLogger(__name__)

SAMPLE_EVERY_S = 0.1
WARMUP_S = 5.0
MIN_WINDOW_S, MAX_WINDOW_S = 1.0, 30.0


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


def sample_prompts(shards: Sequence[Mapping[str, Any]], k: int, seed: int) -> list[dict]:
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
        self.api = Api(server.url, api_key, pool_size=concurrency + 1)
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
            s = self.settings
            payload = chat_payload(messages, tools, s.sampling, model=s.served_model_name,
                                   max_tokens=s.sampling.max_tokens, seed=sample_seed(row["sample_id"], s.seed))
            try:
                result = with_retries(functools.partial(self.api.stream, payload, stall_s=s.stall_timeout_s,
                                                        cap_s=s.request_cap_s, stop=self.stop),
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
