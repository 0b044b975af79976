"""The emulator's knobs from the environment: faults to inject (`DFLASH_EMU_FAULTS`) and the model/speed
profile (`DFLASH_EMU_PROFILE`). Both are JSON objects; see the package docstring for every key.

A bad value is refused at start with a message naming the variable, the key and the rule, so a typo in a
fault never silently runs a healthy server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

FAULTS_VAR = "DFLASH_EMU_FAULTS"
PROFILE_VAR = "DFLASH_EMU_PROFILE"
GPU_VAR = "CUDA_VISIBLE_DEVICES"
ALL_GPUS = "*"


class EmulatorConfigError(ValueError):
    """An emulator environment variable is not valid JSON or holds an unknown key or a bad value."""


@dataclass(frozen=True)
class Faults:
    """Faults for this server (the `*` entry merged with the entry for its GPU id)."""

    kv_tokens: int | None = None
    max_mamba_slots: int | None = None
    empty_content: bool = False
    crash_at_start: bool = False
    start_delay_s: float = 0.0
    crash_after_requests: int | None = None
    http_error_rate: float = 0.0
    hang_rate: float = 0.0
    dead_scheduler_after_requests: int | None = None
    loop_rate: float = 0.0
    loop_substring: str | None = None
    error_substring: str | None = None
    error_status: int = 500
    # A prompt whose last user message holds this text gets prompt ids (where asked) with one id more than the
    # template renders: the server saw another prompt than the client's tokenizer renders.
    wrong_prompt_ids_substring: str | None = None

    def describe(self) -> str:
        active = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}
        return ", ".join(f"{k}={v!r}" for k, v in active.items()) or "none"


MTP_DRAFT_TOKENS = 4  # the cookbook's EAGLE 3/1/4: the published MTP figures were measured with it


@dataclass(frozen=True)
class Profile:
    """Speed and output-length knobs of the emulated model."""

    decode_tokens_per_s: float = 150.0  # per request running alone (every request's rate without a saturation)
    saturation_tokens_per_s: float = 0.0  # aggregate decode ceiling of the GPU; 0 = none (aggregate grows linearly)
    prefill_tokens_per_s: float = 15000.0  # prefill stalls the whole batch, as on a GPU
    mean_output_tokens: float = 1820.0  # reasoning + answer, the seed's mean
    reasoning_share: float = 0.85
    min_reasoning_tokens: int = 600
    max_output_tokens: int = 6000  # natural answers are clipped here (a loop is not)
    accept_length: float = 3.1  # mean tokens per MTP step (1 without speculative decoding)
    # The two decode rates above are the server's with MTP on (the cookbook launch). Without speculative decoding
    # the curve is derived from them by the step model in `decode_curve`, unless these say otherwise (0 = derive).
    no_mtp_decode_tokens_per_s: float = 0.0
    no_mtp_saturation_tokens_per_s: float = 0.0
    mtp_draft_overhead: float = 0.05  # the draft head's share of a decode step's fixed cost (its 3 steps)
    gpu_memory_gb: float = 183.0
    startup_s: float = 0.3  # simulated load + graph-capture time before the HTTP front comes up
    preset: str | None = None  # the named profile these values started from (PRESETS), if any
    sglang_version: str | None = None  # the SGLang version to emulate (versions.DEFAULT_VERSION when unset)

    def decode_curve(self, speculative: bool, num_draft_tokens: int = MTP_DRAFT_TOKENS) -> tuple[float, float]:
        """(tok/s of one request alone, aggregate ceiling) of a server with or without MTP.

        A decode step costs a fixed part W (reading the weights once for the whole batch; with MTP also the
        draft head) and a part per request C for each token it verifies. With MTP a step verifies
        `num_draft_tokens` tokens per request and keeps `accept_length` of them, so per output token
        tpot(b) = (W_mtp + n*C*b) / A; without it a step verifies and keeps one: tpot(b) = W + C*b, where
        W = W_mtp / (1 + mtp_draft_overhead). Fitting tpot_mtp(b) = 1/decode + (b-1)/saturation gives
        C = A / (n * saturation) and W_mtp = A/decode - A/saturation. MTP then wins by ~A/(1+overhead) alone and
        loses n/A (verifying 4 to keep 3.1) once the GPU is compute-bound: SGLang's high-throughput recipes turn
        it off at large batch.
        """
        if speculative:
            return self.decode_tokens_per_s, self.saturation_tokens_per_s
        a, n = self.accept_length, max(num_draft_tokens, 1)
        per_request = a / (n * self.saturation_tokens_per_s) if self.saturation_tokens_per_s else 0.0
        fixed_mtp = a / self.decode_tokens_per_s - (a / self.saturation_tokens_per_s if per_request else 0.0)
        fixed = max(fixed_mtp, 1e-9) / (1 + self.mtp_draft_overhead)
        decode = self.no_mtp_decode_tokens_per_s or 1.0 / (fixed + per_request)
        saturation = self.no_mtp_saturation_tokens_per_s or (1.0 / per_request if per_request else 0.0)
        return decode, saturation


# Profiles fitted to published Qwen3.6-27B figures (MTP on, TP=1, BF16 weights and KV; SGLang's Qwen3.6
# cookbook benchmarks). Per-request decode time grows linearly with the batch, t(b) = 1/decode + (b - 1)/saturation, so
# the two rates are fitted to two points:
# - B200: one request alone ~218 output tok/s (SGLang's Qwen3.6 cookbook benchmark) and the
#   cookbook's c16 TPOT of 10.8 ms (`qwen3.6-benchmarks.jsx`, sglang PR #32959): 15 / (10.8 ms - 1/218) gives an
#   MTP-on ceiling of ~2,400 tok/s, 1,481 tok/s at 16 running (the cookbook's ~1,240 at isl 8192 includes prefill),
#   in line with the maintainers' "saturates by ~conc 16; high-throughput is ~+20% over c16".
# - H200: c1 / c16 TPOT 5.6 / 17.3 ms (same file) -> 178 tok/s alone, ceiling ~1,280 tok/s.
# Without MTP the curve follows from `Profile.decode_curve` with accept length 3.1 of 4 (MTP's acceptance on
# Qwen3.6 as SGLang reports it) and a 5% draft-head overhead (0.86 GB of MTP head run 3 times vs 52 GB of weights, the
# emulator's allocation constants): B200 ~79 tok/s alone, ceiling ~3,100 tok/s, so MTP pays up to ~100 running
# requests and costs above (no published MTP-off decode figure exists for this model; the cookbook's MTP-off
# c1024 point, ~1,350 output tok/s at isl 8192, is prefill-bound and only bounds it from below).
# Radix cache off needs 1 Mamba slot per request instead of 5, so the same memory runs ~3x the batch; sglang PR #27220
# measured 1,977 vs 1,528 output tok/s (1.29x) with it off; the model reproduces that order through the batch alone
# (48 vs 16 running: 1,990 vs 1,481 tok/s, 1.34x), adding no speed factor of its own.
# FP8 KV cache (`--kv-cache-dtype fp8_e4m3`) halves the bytes per KV token (allocation.KV_DTYPE_SCALE): room, not
# speed (the cookbook's FP8 figures, ~1,600 vs ~1,240 at c16, are FP8 *weights*, which this pipeline does not change).
# Prefill is an effective rate: it makes the published c16 output throughput (~1,240 tok/s on B200 at isl 8192,
# below the 1,481 of pure decode) come out of the same curve; with ~600-token prompts it hardly matters.
PRESETS: dict[str, dict] = {
    "qwen3.6-27b-b200-mtp": {"decode_tokens_per_s": 218.0, "saturation_tokens_per_s": 2414.0,
                             "prefill_tokens_per_s": 60000.0, "accept_length": 3.1, "gpu_memory_gb": 183.0},
    "qwen3.6-27b-h200-mtp": {"decode_tokens_per_s": 178.0, "saturation_tokens_per_s": 1280.0,
                             "prefill_tokens_per_s": 30000.0, "accept_length": 3.1, "gpu_memory_gb": 141.0},
    # For tests: not a GPU but curves with a known best setting among autotune's default candidates. MTP pays 1.6x
    # alone and loses at 16 running (its ceiling is a tenth of the plain one's), so MTP off at the largest batch wins.
    "synthetic-known-optimum": {"decode_tokens_per_s": 400.0, "saturation_tokens_per_s": 4000.0,
                                "no_mtp_decode_tokens_per_s": 200.0, "no_mtp_saturation_tokens_per_s": 40000.0,
                                "prefill_tokens_per_s": 200000.0, "mean_output_tokens": 100.0,
                                "min_reasoning_tokens": 30, "startup_s": 0.1},
}


_RATES = {"http_error_rate", "hang_rate", "loop_rate", "reasoning_share"}
_POSITIVE = {"decode_tokens_per_s", "prefill_tokens_per_s", "mean_output_tokens", "gpu_memory_gb",
             "accept_length", "max_output_tokens"}  # the no_mtp_* rates may be 0 (= derived)


def _check_value(var: str, where: str, name: str, value, field_type: str):
    """The value converted to the field's type, or EmulatorConfigError saying what is expected."""
    given = value

    def bad(rule: str) -> EmulatorConfigError:
        return EmulatorConfigError(f"{var}: key {name!r}{where} = {given!r} is invalid: {rule}")

    base = field_type.replace(" | None", "")
    if value is None and "None" in field_type:
        return None
    if base == "bool":
        if not isinstance(value, bool):
            raise bad("must be true or false")
        return value
    if base == "str":
        if not isinstance(value, str) or not value:
            raise bad("must be a non-empty string")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad("must be a number")
    if base == "int":
        if value != int(value):
            raise bad("must be a whole number")
        value = int(value)
    else:
        value = float(value)
    if name in _RATES and not 0 <= value <= 1:
        raise bad("must be between 0 and 1")
    if name == "error_status" and not 400 <= value <= 599:
        raise bad("must be an HTTP error status, 400 to 599")
    if name in _POSITIVE and value <= 0:
        raise bad("must be > 0")
    if value < 0:
        raise bad("must be >= 0")
    return value


def _build(cls, var: str, where: str, raw: dict):
    known = {f.name: f.type for f in fields(cls)}
    values = {}
    for name, value in raw.items():
        if name not in known:
            raise EmulatorConfigError(f"{var}: unknown key {name!r}{where}; known keys: {', '.join(known)}")
        values[name] = _check_value(var, where, name, value, str(known[name]))
    return cls(**values)


def _load_object(var: str, text: str | None) -> dict:
    if not text or not text.strip():
        return {}
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise EmulatorConfigError(f"{var} is not valid JSON ({exc}); give a JSON object, e.g. "
                                  f"{var}='{{\"*\": {{\"hang_rate\": 0.1}}}}'" if var == FAULTS_VAR else
                                  f"{var} is not valid JSON ({exc}); give a JSON object, e.g. "
                                  f"{var}='{{\"decode_tokens_per_s\": 20000}}'") from exc
    if not isinstance(raw, dict):
        raise EmulatorConfigError(f"{var} must be a JSON object, got {type(raw).__name__}")
    return raw


def load_faults(env: dict[str, str]) -> Faults:
    """Faults for the GPU in `CUDA_VISIBLE_DEVICES` (default "0"): the `*` entry, overridden by its own.

    Every entry is validated, not only this GPU's, so a typo fails every server the same way.
    """
    raw = _load_object(FAULTS_VAR, env.get(FAULTS_VAR))
    gpu = gpu_id(env)
    parsed: dict[str, Faults] = {}
    for key, entry in raw.items():
        if not isinstance(entry, dict):
            raise EmulatorConfigError(f"{FAULTS_VAR}: the entry for GPU {key!r} must be an object of faults, "
                                      f"got {entry!r}")
        parsed[str(key)] = _build(Faults, FAULTS_VAR, f" (GPU {key!r})", entry)
    values: dict = {}
    for key in (ALL_GPUS, gpu):  # the GPU's own entry wins over "*"
        if key in parsed:
            values.update({name: getattr(parsed[key], name) for name in raw[key]})
    return Faults(**values)


def load_profile(env: dict[str, str]) -> Profile:
    """The profile: a `preset`'s values (if named), overridden by the other keys."""
    raw = _load_object(PROFILE_VAR, env.get(PROFILE_VAR))
    preset = raw.get("preset")
    if preset is not None and preset not in PRESETS:
        raise EmulatorConfigError(f"{PROFILE_VAR}: key 'preset' = {preset!r} is invalid: known presets are "
                                  f"{', '.join(PRESETS)}")
    profile = _build(Profile, PROFILE_VAR, "", {**(PRESETS[preset] if preset is not None else {}), **raw})
    if profile.sglang_version is not None:
        from dflash_regen.emulator.versions import SUPPORTED, _key

        try:
            key = _key(profile.sglang_version)
        except ValueError as exc:
            raise EmulatorConfigError(f"{PROFILE_VAR}: key 'sglang_version' is invalid: {exc}") from exc
        if not _key(SUPPORTED[0]) <= key:
            raise EmulatorConfigError(f"{PROFILE_VAR}: key 'sglang_version' = {profile.sglang_version!r} is invalid: "
                                      f"the emulator emulates {SUPPORTED[0]} and later")
    if profile.saturation_tokens_per_s and profile.saturation_tokens_per_s < profile.decode_tokens_per_s:
        raise EmulatorConfigError(f"{PROFILE_VAR}: key 'saturation_tokens_per_s' = {profile.saturation_tokens_per_s:g}"
                                  f" is invalid: must be 0 (no ceiling) or >= decode_tokens_per_s "
                                  f"({profile.decode_tokens_per_s:g}): a batch cannot be slower than one request")
    return profile


def gpu_id(env: dict[str, str]) -> str:
    return (env.get(GPU_VAR) or "0").split(",")[0].strip() or "0"
