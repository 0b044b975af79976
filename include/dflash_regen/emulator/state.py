"""What the emulator's routes share: the resolved config, allocation, faults, scheduler and lifecycle status."""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from dataclasses import dataclass, field

import uvicorn

from dflash_regen.emulator.allocation import Allocation
from dflash_regen.emulator.cli import ModelConfig, ServerArgs, context_len
from dflash_regen.emulator.faults import Faults, Profile
from dflash_regen.emulator.scheduler import Scheduler
from dflash_regen.emulator.versions import Forms

log = logging.getLogger("sglang.srt.entrypoints.http_server")  # SGLang's logger: the log reads as its own


@dataclass
class Emulator:
    """Everything the routes share: resolved config, allocation, faults, scheduler, lifecycle status."""

    args: ServerArgs  # as the scheduler sees them (the model runner wrote the sized Mamba slots back)
    launch_args: ServerArgs  # as resolved from the command line: /server_info's top level echoes these
    forms: Forms
    model: ModelConfig
    alloc: Allocation
    faults: Faults
    profile: Profile
    gpu: str
    scheduler: Scheduler
    status: str = "Starting"  # Starting -> Up (after warmup) -> UnHealthy (failed health check)
    shutting_down: bool = False
    started_at: float = field(default_factory=time.time)
    load_weights_s: float = 0.0
    startup_s: float = 0.0
    chat_arrivals: int = 0
    http_server: uvicorn.Server | None = None

    def __post_init__(self):
        # One draw sequence per server, in arrival order: deterministic for tests, fresh on retries.
        self.fault_rng = random.Random(f"dflash-emu-faults-{self.gpu}")

    @property
    def context_len(self) -> int:
        return context_len(self.args, self.model)

    @property
    def max_req_input_len(self) -> int:
        max_req_len = min(self.context_len - 1, self.alloc.max_total_num_tokens - 1)
        return max_req_len - 5

    def server_args_dict(self) -> dict:
        return self.args.as_dict(self.forms)


def kill_self() -> None:
    """An abrupt death, as when SGLang's scheduler child dies and takes the server with it."""
    log.error("Received sigquit from a child process. It usually means the child failed.")
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)
