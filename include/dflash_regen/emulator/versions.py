"""Which SGLang the emulator emulates, and what differs between the versions it can emulate.

Chosen by the profile key `sglang_version` (`DFLASH_EMU_PROFILE`); default `DEFAULT_VERSION`, the version
`scripts/build-sglang-venv.sh` installs. Each difference is the first release seen with it among the
wheels read (0.5.10, .12, .13, .14, .16, .18, .20, .21, .22, .23); the contract tests (`tests/contract/`)
check the oldest and the newest against SGLang's own code. No import of the library: the emulator stays a
stand-alone process.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

DEFAULT_VERSION = "0.5.16"
SUPPORTED = ("0.5.10", "0.5.23")  # the range's ends; any version in between is emulated by its thresholds


def _key(version: str) -> tuple[int, ...]:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"SGLang version {version!r} is not MAJOR.MINOR.PATCH (e.g. 0.5.10)")
    return tuple(int(g) for g in m.groups())


@dataclass(frozen=True)
class Forms:
    version: str

    def at_least(self, other: str) -> bool:
        return _key(self.version) >= _key(other)

    @property
    def radix_cache_strategy_flag(self) -> bool:  # --mamba-radix-cache-strategy (+ extra_buffer_lazy)
        return self.at_least("0.5.14")

    @property
    def scheduler_strategy_alias(self) -> bool:  # the old --mamba-scheduler-strategy name still parses
        return not self.at_least("0.5.20")

    @property
    def cuda_graph_max_bs_flag(self) -> bool:
        return not self.at_least("0.5.20")

    @property
    def reads_spec_v2_env(self) -> bool:  # from 0.5.14 spec v2 is always on (overlap unless disabled)
        return not self.at_least("0.5.14")

    @property
    def kv_line_dtype(self) -> bool:  # "KV Cache is allocated. dtype: ..., #tokens: N"
        return self.at_least("0.5.13")

    @property
    def empty_content_is_string(self) -> bool:  # content "" instead of null
        return self.at_least("0.5.13")

    @property
    def logs_mamba_cap(self) -> bool:  # "max_running_requests is capped to N by the mamba state cache"
        return self.at_least("0.5.18")

    @property
    def is_streaming_label(self) -> bool:  # token/request counters, latency histograms split by is_streaming;
        # engine_startup_time and engine_load_weights_time become startup_time_seconds{phase} (emulator/metrics.py)
        return self.at_least("0.5.18")

    @property
    def omits_null_tool_calls(self) -> bool:  # ChatMessage's serializer drops tool_calls when None
        return self.at_least("0.5.22")

    @property
    def completion_tokens_details(self) -> bool:  # usage.completion_tokens_details.reasoning_tokens
        return self.at_least("0.5.23")

    # Token ids (protocol.py's request and response models, serving_chat.py): `return_prompt_token_ids` (0.5.13) ->
    # `choices[i].prompt_token_ids`; `return_token_ids` (0.5.17) -> that and the output's ids in `choices[i].token_ids`,
    # `response_token_ids` from 0.5.18; both refused with `stream`. `return_input_ids_in_sglext` and
    # `return_output_ids_in_sglext` (0.5.20) -> top-level `sglext.input_ids`, `sglext.output_ids` (streaming too).
    @property
    def return_prompt_token_ids(self) -> bool:
        return self.at_least("0.5.13")

    @property
    def output_token_ids_field(self) -> str | None:
        if self.at_least("0.5.18"):
            return "response_token_ids"
        return "token_ids" if self.at_least("0.5.17") else None

    @property
    def ids_in_sglext(self) -> bool:
        return self.at_least("0.5.20")

    def template_tools(self, tools: list[dict] | None) -> list[dict] | None:
        """The tools as this version's server hands them to the chat template (`item.model_dump()` of its `Tool`):
        before 0.5.12 `strict` false unless sent; from 0.5.12 a `defer_loading` on each tool; from 0.5.23 the
        function's keys in the order sent, `strict` and `defer_loading` only when sent."""
        return [self._template_tool(tool) for tool in tools] if tools else tools

    def _template_tool(self, tool: dict) -> dict:
        sent = tool.get("function") or {}
        defer = tool.get("defer_loading")
        function = {"description": sent.get("description"), "name": sent.get("name"),
                    "parameters": sent.get("parameters")}
        if not self.at_least("0.5.12"):
            return {"type": tool.get("type", "function"), "function": {**function,
                                                                       "strict": bool(sent.get("strict", False))}}
        function_defer = sent.get("defer_loading", defer)
        if self.at_least("0.5.23"):
            known = {**function, "strict": sent.get("strict"), "defer_loading": function_defer}
            known = {k: v for k, v in known.items() if v is not None or k not in ("strict", "defer_loading")}
            function = {k: known[k] for k in [*sent, *known] if k in known}
        else:
            function["strict"] = bool(sent.get("strict", False))
            if function_defer is not None:
                function["defer_loading"] = function_defer
        return {"type": tool.get("type", "function"), "function": function, "defer_loading": defer}


def emulated_version(env: dict[str, str] | None = None) -> str:
    """The version the profile asks for (what the launcher's pre-flight reads as `sglang.__version__`)."""
    import json

    raw = (env if env is not None else os.environ).get("DFLASH_EMU_PROFILE") or "{}"
    try:
        version = json.loads(raw).get("sglang_version") or DEFAULT_VERSION
    except (ValueError, AttributeError):
        version = DEFAULT_VERSION
    return version
