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

    def describe(self) -> str:
        active = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}
        return ", ".join(f"{k}={v!r}" for k, v in active.items()) or "none"


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
    gpu_memory_gb: float = 183.0
    startup_s: float = 0.3  # simulated load + graph-capture time before the HTTP front comes up
    preset: str | None = None  # the named profile these values started from (PRESETS), if any
    sglang_version: str | None = None  # the SGLang version to emulate (versions.DEFAULT_VERSION when unset)


# Profiles fitted to SGLang's published Qwen3.6-27B figures (cookbook `qwen3.6-benchmarks.jsx`, TP=1, BF16, MTP
# on, isl 8192 / osl 1024; notes/peers-and-pain-points.md §4). Per-request decode time grows linearly with the
# batch, t(b) = 1/decode + (b - 1)/saturation, so the two rates are fitted to two TPOTs:
# - B200 c16: TPOT 10.8 ms. B200 c1 is not published: H200's c1 TPOT (5.6 ms) scaled by HBM bandwidth
#   (4.8 -> 8 TB/s) gives 3.4 ms, i.e. ~300 tok/s alone; then 16 / 10.8 ms = 1,481 tok/s at c16 and a ceiling of
#   ~2,000 tok/s, in line with the maintainers' "saturates by ~conc 16; high-throughput is ~+20% over c16".
# - H200 c1 / c16: TPOT 5.6 / 17.3 ms -> 178 tok/s alone, ceiling ~1,280 tok/s.
# Prefill is an effective rate: it makes the published c16 output throughput (~1,240 tok/s on B200 at isl 8192,
# below the 1,481 of pure decode) come out of the same curve; with ~600-token prompts it hardly matters.
PRESETS: dict[str, dict] = {
    "qwen3.6-27b-b200-mtp": {"decode_tokens_per_s": 300.0, "saturation_tokens_per_s": 2000.0,
                             "prefill_tokens_per_s": 60000.0, "accept_length": 3.1, "gpu_memory_gb": 183.0},
    "qwen3.6-27b-h200-mtp": {"decode_tokens_per_s": 178.0, "saturation_tokens_per_s": 1280.0,
                             "prefill_tokens_per_s": 30000.0, "accept_length": 3.1, "gpu_memory_gb": 141.0},
}


_RATES = {"http_error_rate", "hang_rate", "loop_rate", "reasoning_share"}
_POSITIVE = {"decode_tokens_per_s", "prefill_tokens_per_s", "mean_output_tokens", "gpu_memory_gb",
             "accept_length", "max_output_tokens"}


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
    profile = _build(Profile, PROFILE_VAR, "", {**PRESETS.get(preset, {}), **raw})
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
