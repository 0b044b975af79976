"""The emulated SGLang scheduler: running-request slots, a FIFO waiting queue, prefill and decode pacing.

One asyncio loop plays the GPU. Each iteration admits waiting requests while there are free slots (the
effective max running requests, i.e. Mamba slots // ratio) and room in the KV pool, runs their prefill
— which stalls every running request, as a prefill batch does on the GPU — then advances each running
request at the decode rate of the current batch size (`Pace.per_request_rate`) in MTP steps of
1..num_draft_tokens tokens. Iterations are at least 5 ms apart, so a very fast decode rate produces a few
large updates rather than thousands of tiny ones.

It also logs SGLang's `Prefill batch` (throttled to about one a second) and `Decode batch` (about every
2 s at the default `--decode-log-interval 40`) lines. `wedge()` freezes it for good: no tokens, no log
lines, while the HTTP front keeps answering (the dead-scheduler fault).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from dataclasses import dataclass, field

log = logging.getLogger("sglang.srt.managers.scheduler")

MIN_TICK_S = 0.005
MAX_TICK_S = 0.05
PREFILL_LOG_EVERY_S = 1.0
DECODE_LOG_EVERY_S = 2.0  # at --decode-log-interval 40; scales with it
# Without knowing the output length, admission reserves part of max_new_tokens (SGLang's new_token_ratio).
ADMISSION_NEW_TOKEN_RATIO = 0.3
ADMISSION_MAX_RESERVE = 4096
# SGLang's default histogram buckets (srt/observability/metrics_collector.py, the same from 0.5.10 to 0.5.23).
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = TTFT_BUCKETS + (600, 1200, 1800, 2400)


@dataclass
class Histogram:
    """A Prometheus histogram's state: cumulative count per upper bound (+Inf last), sum and count."""

    bounds: tuple[float, ...]
    cumulative: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        if not self.cumulative:
            self.cumulative = [0] * (len(self.bounds) + 1)
        for i, bound in enumerate((*self.bounds, float("inf"))):
            self.cumulative[i] += value <= bound
        self.sum += value
        self.count += 1


class QueueFull(Exception):
    """More requests waiting than `--max-queued-requests` allows."""


@dataclass(eq=False)
class Req:
    """One generation request as the scheduler sees it."""

    rid: str
    prompt_tokens: int
    output: list[int]  # every token the request will produce (already cut at max_new_tokens)
    max_new_tokens: int | None = None
    counted: bool = True  # False for health checks: no metrics
    streaming: bool = False  # metrics split by is_streaming (SGLang 0.5.18+)
    emitted: int = 0
    state: str = "waiting"  # waiting -> running -> finished | aborted
    queued_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    credit: float = 0.0
    next_step: int = 1
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def done(self) -> bool:
        return self.state in {"finished", "aborted"}

    async def updates(self):
        """Yield each batch of newly emitted token ids until the request finishes or is aborted."""
        sent = 0
        while True:
            if self.emitted > sent:
                new, sent = self.output[sent:self.emitted], self.emitted
                yield new
                continue
            if self.done:
                return
            await self.changed.wait()
            self.changed.clear()

    async def wait(self) -> None:
        while not self.done:
            await self.changed.wait()
            self.changed.clear()


@dataclass(frozen=True)
class Limits:
    max_running_requests: int  # effective, Mamba-capped
    max_queued_requests: int | None
    max_total_num_tokens: int
    mamba_slots: int | None
    mamba_ratio: int | None
    hybrid: bool


@dataclass(frozen=True)
class Pace:
    decode_tokens_per_s: float  # one request running alone
    prefill_tokens_per_s: float
    num_draft_tokens: int | None  # None without speculative decoding
    accept_length: float
    decode_log_every_s: float = DECODE_LOG_EVERY_S
    saturation_tokens_per_s: float = 0.0  # aggregate ceiling; 0 = every request at decode_tokens_per_s

    def per_request_rate(self, batch: int) -> float:
        """Decode tokens/s of each of `batch` running requests.

        A decode step reads the weights once for the whole batch (a fixed cost) and does per-request work
        (attention, MTP verification), so its time grows linearly with the batch: per-request rate falls as
        1 / (1/decode + (b - 1)/saturation) while the aggregate b x rate approaches `saturation`.
        """
        if not self.saturation_tokens_per_s:
            return self.decode_tokens_per_s
        return 1.0 / (1.0 / self.decode_tokens_per_s + max(batch - 1, 0) / self.saturation_tokens_per_s)


class Scheduler:
    def __init__(self, limits: Limits, pace: Pace, seed: int = 0):
        self.limits = limits
        self.pace = pace
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.wedged = False
        self.last_output_at = 0.0  # monotonic time of the last token produced by any request
        self.last_output_wall = 0.0
        self.last_gen_throughput = 0.0
        self.spec_accepted = 0
        self.spec_steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.streamed_prompt_tokens_total = 0  # the streaming requests' share of the two counters
        self.streamed_generation_tokens_total = 0
        self.num_requests_total = 0
        self.streamed_num_requests_total = 0
        self.num_aborted_requests_total = 0
        # finished requests' time to first token and end-to-end latency, by streaming (True) or not (False)
        self.ttft = {streaming: Histogram(TTFT_BUCKETS) for streaming in (True, False)}
        self.e2e = {streaming: Histogram(E2E_BUCKETS) for streaming in (True, False)}
        self._rng = random.Random(seed)
        self._wake = asyncio.Event()
        self._tokens_since_log = 0
        self._last_decode_log = time.monotonic()
        self._pending_prefill = [0, 0]  # new seqs, new tokens not yet logged
        self._last_prefill_log = 0.0
        self._last_prefill_at = time.monotonic()
        draft = pace.num_draft_tokens
        self._p_accept = 0.0
        if draft and draft > 1:
            self._p_accept = min(max((min(pace.accept_length, draft) - 1) / (draft - 1), 0.0), 1.0)
        mean_step = 1 + self._p_accept * ((draft or 1) - 1)
        self.tick_s = min(max(mean_step / pace.decode_tokens_per_s, MIN_TICK_S), MAX_TICK_S)

    # ------------------------------------------------------------------------------------- requests
    def submit(self, req: Req) -> None:
        queued = len(self.running) + len(self.waiting) - self.limits.max_running_requests
        if self.limits.max_queued_requests is not None and req.counted and queued >= self.limits.max_queued_requests:
            raise QueueFull("The request queue is full.")
        req.next_step = self._draw_step()
        self.waiting.append(req)
        self._wake.set()

    def abort(self, req: Req) -> None:
        """Drop a request (client gone, or a health probe that has its answer); frees its slot."""
        if req.done:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.state = "aborted"
        req.finished_at = time.monotonic()
        if req.counted:
            self.num_aborted_requests_total += 1
        req.changed.set()
        self._wake.set()

    def wedge(self) -> None:
        self.wedged = True

    @property
    def kv_used(self) -> int:
        return sum(r.prompt_tokens + r.emitted for r in self.running)

    @property
    def mamba_used(self) -> int:
        if not self.limits.mamba_slots:
            return 0
        return min(self.limits.mamba_slots, len(self.running) * (self.limits.mamba_ratio or 1))

    @property
    def avg_spec_accept_length(self) -> float | None:
        return self.spec_accepted / self.spec_steps if self.spec_steps and self.pace.num_draft_tokens else None

    # ----------------------------------------------------------------------------------------- loop
    async def run(self) -> None:
        last = time.monotonic()
        while True:
            if self.wedged:
                await asyncio.Event().wait()  # nobody sets it: the scheduler is stuck for good
            admitted = self._admit()
            if admitted:
                await self._prefill(admitted)
                last = time.monotonic()
            self._maybe_log_prefill()
            if not self.running:
                await self._idle()
                last = self._last_decode_log = time.monotonic()
                self._tokens_since_log = 0
                continue
            await asyncio.sleep(self.tick_s)
            if self.wedged:
                continue
            now = time.monotonic()
            self._decode(now - last, now)
            last = now
            self._maybe_log_decode(now)

    async def _idle(self) -> None:
        """Wait for a request; wake in time to log a pending prefill line (it is throttled, not dropped)."""
        self._wake.clear()
        if self.waiting:
            return
        timeout = None
        if self._pending_prefill[0]:
            timeout = max(PREFILL_LOG_EVERY_S - (time.monotonic() - self._last_prefill_log), 0.0)
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            pass

    def _admit(self) -> list[Req]:
        admitted: list[Req] = []
        kv_free = self.limits.max_total_num_tokens - self.kv_used
        while self.waiting and len(self.running) + len(admitted) < self.limits.max_running_requests:
            req = self.waiting[0]
            reserve = min(req.max_new_tokens or ADMISSION_MAX_RESERVE, ADMISSION_MAX_RESERVE)
            need = req.prompt_tokens + int(reserve * ADMISSION_NEW_TOKEN_RATIO)
            if (self.running or admitted) and need > kv_free:
                break  # KV pool full: wait for running requests to finish
            self.waiting.popleft()
            kv_free -= need
            admitted.append(req)
        return admitted

    async def _prefill(self, admitted: list[Req]) -> None:
        tokens = sum(r.prompt_tokens for r in admitted)
        stall = tokens / self.pace.prefill_tokens_per_s
        if stall > 0.0005:
            await asyncio.sleep(stall)
        now = time.monotonic()
        for req in admitted:
            if req.done:  # aborted during the prefill
                continue
            req.state = "running"
            self.running.append(req)
            self._emit(req, 1, now)  # the prefill forward yields the first token
            req.first_token_at = now
            if req.counted:
                self.prompt_tokens_total += req.prompt_tokens
                self.streamed_prompt_tokens_total += req.prompt_tokens if req.streaming else 0
        self._pending_prefill[0] += len(admitted)
        self._pending_prefill[1] += tokens
        self._last_prefill_at = now

    def _decode(self, dt: float, now: float) -> None:
        rate = self.pace.per_request_rate(len(self.running))
        for req in list(self.running):
            req.credit += dt * rate
            progressed = 0
            while req.credit >= req.next_step and req.emitted + progressed < len(req.output):
                step = req.next_step
                req.credit -= step
                progressed += step
                if self.pace.num_draft_tokens:
                    self.spec_accepted += step
                    self.spec_steps += 1
                req.next_step = self._draw_step()
            if progressed:
                self._emit(req, progressed, now)

    def _emit(self, req: Req, n: int, now: float) -> None:
        n = min(n, len(req.output) - req.emitted)
        if n > 0:
            req.emitted += n
            self._tokens_since_log += n
            if req.counted:
                self.generation_tokens_total += n
                self.streamed_generation_tokens_total += n if req.streaming else 0
        self.last_output_at = now
        self.last_output_wall = time.time()
        if req.emitted >= len(req.output):
            req.state = "finished"
            req.finished_at = now
            if req in self.running:
                self.running.remove(req)
            if req.counted:
                self.num_requests_total += 1
                self.streamed_num_requests_total += req.streaming
                self.ttft[req.streaming].observe((req.first_token_at or now) - req.queued_at)
                self.e2e[req.streaming].observe(now - req.queued_at)
        req.changed.set()

    def _draw_step(self) -> int:
        """Tokens accepted in one decode step: 1 + Binomial(num_draft_tokens - 1, p) with MTP, else 1."""
        draft = self.pace.num_draft_tokens
        if not draft or draft <= 1:
            return 1
        return 1 + sum(self._rng.random() < self._p_accept for _ in range(draft - 1))

    # -------------------------------------------------------------------------------------- logging
    def usage_msg(self, prefill: bool = False) -> str:
        kv_used = self.kv_used
        usage = kv_used / self.limits.max_total_num_tokens
        if not self.limits.hybrid:
            return f"#token: {kv_used}, token usage: {usage:.2f}, "
        mamba = self.mamba_used / self.limits.mamba_slots if self.limits.mamba_slots else 0.0
        if prefill:
            return f"full token usage: {usage:.2f}, mamba usage: {mamba:.2f}, "
        return f"#full token: {kv_used}, full token usage: {usage:.2f}, mamba num: {self.mamba_used}, " \
               f"mamba usage: {mamba:.2f}, "

    def _maybe_log_prefill(self) -> None:
        seqs, tokens = self._pending_prefill
        now = time.monotonic()
        if not seqs or now - self._last_prefill_log < PREFILL_LOG_EVERY_S:
            return
        gap = max(now - self._last_prefill_log, 1e-6) if self._last_prefill_log else max(
            now - self._last_prefill_at, 1e-6)
        throughput = tokens / gap if self._last_prefill_log else 0.0
        log.info(f"Prefill batch, #new-seq: {seqs}, #new-token: {tokens}, #cached-token: 0, "
                 f"{self.usage_msg(prefill=True)}#running-req: {len(self.running)}, #queue-req: {len(self.waiting)}, "
                 f"cuda graph: False, input throughput (token/s): {throughput:.2f}")
        self._pending_prefill = [0, 0]
        self._last_prefill_log = now

    def _maybe_log_decode(self, now: float) -> None:
        elapsed = now - self._last_decode_log
        if elapsed < self.pace.decode_log_every_s:
            return
        self.last_gen_throughput = self._tokens_since_log / elapsed
        self._tokens_since_log = 0
        self._last_decode_log = now
        spec = ""
        if self.pace.num_draft_tokens and self.spec_steps:
            accept = self.spec_accepted / self.spec_steps
            spec = f"accept len: {accept:.2f}, accept rate: {accept / self.pace.num_draft_tokens:.2f}, "
        log.info(f"Decode batch, #running-req: {len(self.running)}, {self.usage_msg()}{spec}cuda graph: True, "
                 f"gen throughput (token/s): {self.last_gen_throughput:.2f}, #queue-req: {len(self.waiting)}")
