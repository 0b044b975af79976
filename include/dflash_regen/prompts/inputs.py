"""The run's inputs, checked in the first task, before any weights are copied or servers started.

A missing prompt source, one with no usable row, or an output root the worker cannot write would otherwise
surface only after staging, launch, health and smoke had run (or as a bare `OSError`). Each check raises
`ConfigError` naming the Param and the fix. The prompt rows are read with planning's own reader
(`prompts.sources.iter_raw` + `prompts.formats.parse_row`), so "usable" means what planning will accept.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from dflash_regen.errors import ConfigError
from dflash_regen.prompts.formats import Rejection, parse_row
from dflash_regen.prompts.sources import iter_raw

ROWS_LOOKED_AT = 1000  # enough to find a usable row in any plausible source; planning reads the rest


def check_output_root(root: Path) -> None:
    """The root exists (or can be made) and takes a file: runs, reports and the published dataset go there."""
    probe = root / f".write-check-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"Param output_root {str(root)!r} is not writable by uid {os.getuid()} "
                          f"({exc.strerror or exc}): set it to a "
                          "directory this worker can write (e.g. a data disk with free space), or fix its "
                          "permissions/mount; nothing was staged or launched") from exc
    if not os.access(root, os.W_OK | os.X_OK):
        raise ConfigError(f"Param output_root {str(root)!r} is not writable by uid {os.getuid()}: fix its "
                          "permissions or choose another directory; nothing was staged or launched")


def check_prompt_source(source: Path, prompt_format: str = "auto") -> str:
    """The source exists and one of its first rows is a prompt planning accepts; returns where that row is."""
    reasons: dict[str, str] = {}
    seen = 0
    for location, raw in iter_raw(source):  # PromptSourceError (missing, no readable files) names the Param
        row = parse_row(location, raw, prompt_format)
        if not isinstance(row, Rejection):
            return location
        reasons.setdefault(row.reason, f"{location}: {row.detail}")
        seen += 1
        if seen >= ROWS_LOOKED_AT:
            break
    if not seen:
        raise ConfigError(f"Param prompt_source {str(source)!r} has no rows (its files are empty): point it at "
                          "the prompts to regenerate")
    examples = "; ".join(f"{reason} ({where})" for reason, where in list(reasons.items())[:3])
    raise ConfigError(f"Param prompt_source {str(source)!r}: none of its first {seen:,} rows is a usable prompt, "
                      f"e.g. {examples}. Fix the rows (see Param prompt_format for the formats read) or point the "
                      "Param at the right source")
