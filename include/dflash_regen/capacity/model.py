"""The planner's pure model: no server, no files. Throughput vs batch (`Curve`), one server's memory (`Memory`),
what binds its running batch (`binding_resource`), the flags that lift it (`advise`), and the run's wall time and
GPU-hours (`predict`, simulating each shard and spreading the shards over the servers)."""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass

import numpy as np

from dflash_regen.errors import CapacityError

COMPUTE_GAIN = 0.10  # doubling the batch adds less than this: the GPU, not a setting, is the limit
KV_HEADROOM = 1.25  # KV tokens per request of mean size the advised batch must keep (SGLang retracts when full)
GRAPH_BATCH = 8  # SGLang captures CUDA graphs at batch sizes in steps of 8: advise a multiple of it
INTERVAL = (10, 90)  # percentiles of the reported interval


def _matrix2(rows: list[list[float]]) -> tuple[tuple[float, float], tuple[float, float]]:
    (a, b), (c, d) = rows
    return (float(a), float(b)), (float(c), float(d))


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
        return cls(a=a, k=k, cov=_matrix2(cov.tolist()), measured_up_to=up_to)

    def to_dict(self) -> dict:
        return {"tpot_a_s": self.a, "tpot_k_s": self.k, "cov": [list(r) for r in self.cov],
                "single_request_tok_s": round(self.per_request(1), 1),
                "saturation_tok_s": round(self.saturation, 1) if self.saturation else None,
                "measured_up_to": self.measured_up_to}

    @classmethod
    def from_dict(cls, d: dict) -> Curve:
        return cls(a=d["tpot_a_s"], k=d["tpot_k_s"], cov=_matrix2(d["cov"]),
                   measured_up_to=d["measured_up_to"])


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
        return self.kv_tokens_at(1) is not None

    def kv_tokens_at(self, running: int, speculative: bool = True) -> int | None:
        """KV tokens with `--max-mamba-cache-size running*ratio --max-running-requests running`, same memory
        (without MTP, `speculative=False`, the draft's reserve goes to the pool too)."""
        kv_gb, mamba_gb, reserve_gb, mamba_slots, ratio = (self.kv_gb, self.mamba_gb, self.reserve_gb,
                                                           self.mamba_slots, self.mamba_ratio)
        if not (kv_gb and mamba_gb and mamba_slots and ratio and reserve_gb is not None and self.kv_tokens):
            return None
        pool = kv_gb + mamba_gb + reserve_gb
        reserve_per_request = reserve_gb / (self.max_running_requests or self.running_slots) if speculative \
            else 0.0
        left = pool - running * ratio * mamba_gb / mamba_slots - running * reserve_per_request
        return max(int(left / (kv_gb / self.kv_tokens)), 0)

    def to_dict(self) -> dict:
        return asdict(self)


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


@dataclass(frozen=True)
class Binding:
    """What caps one server's running batch, and the batch it runs."""

    resource: str  # "client concurrency", "KV tokens", "Mamba slots" or "running requests"
    running: int  # requests the server runs at once
    kv_fit: int  # requests of the given size its KV cache holds


def binding_resource(mem: Memory, request_tokens: float, client: int = 0) -> Binding:
    """The one binding-resource verdict: health_check's table and calibrate's plan both show it.

    `client` is the requests the client keeps in flight (0: as many as the slots). The KV cache binds only when it
    holds fewer requests than the slots: at equality the server runs every slot, so the slot cap is what binds.
    """
    client = client or mem.running_slots
    kv_fit = _kv_fit(mem.kv_tokens, request_tokens)
    if client < mem.running_slots and client <= kv_fit:
        return Binding("client concurrency", client, kv_fit)
    if kv_fit < mem.running_slots:
        return Binding("KV tokens", max(kv_fit, 1), kv_fit)
    mamba_capped = bool(mem.mamba_slots and mem.mamba_ratio and mem.running_slots == mem.mamba_slots // mem.mamba_ratio
                        and (mem.max_running_requests is None or mem.running_slots < mem.max_running_requests))
    return Binding("Mamba slots" if mamba_capped else "running requests", mem.running_slots, kv_fit)


def running_batch(mem: Memory, shape: RunShape, request_tokens: float) -> tuple[int, str]:
    """(requests a server actually runs at once, what caps it)."""
    verdict = binding_resource(mem, request_tokens, shape.concurrency_per_server)
    return verdict.running, verdict.resource


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
                    if all((m.kv_tokens_at(n) or 0) >= KV_HEADROOM * n * request_tokens for m in mems)]
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
