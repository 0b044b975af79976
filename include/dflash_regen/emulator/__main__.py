"""`python -m dflash_regen.emulator <SGLang launch flags>`: start one emulated SGLang server.

Order as SGLang's: parse flags (argparse errors exit 2), resolve them (SGLang's ValueErrors escape as a
traceback, exit 1), log the loading sequence, then serve HTTP; `/health` turns 200 after the warmup.
The web stack and the vocabulary load in a background thread while the loading sequence sleeps, so a
server with default settings is ready in about a second.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time

from dflash_regen.emulator import allocation, cli, startup, versions
from dflash_regen.emulator.faults import EmulatorConfigError, gpu_id, load_faults, load_profile

log = logging.getLogger("sglang.srt.entrypoints.engine")


def configure_logging(level: str) -> None:
    """SGLang's `configure_logger`: `[YYYY-mm-dd HH:MM:SS] message` on stderr."""
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format="[%(asctime)s] %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", stream=sys.stderr, force=True)


def _exit_quietly(signum, frame) -> None:
    raise SystemExit(0)  # stopped while still loading: nothing to drain


class _Preload(threading.Thread):
    """Imports FastAPI/uvicorn and loads the vocabulary while the main thread logs the loading sequence."""

    def __init__(self) -> None:
        super().__init__(name="preload", daemon=True)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            from dflash_regen.emulator import model, server  # noqa: F401  (import is the work)

            model.tokenizer()
        except BaseException as exc:  # re-raised in the main thread, where it belongs
            self.error = exc


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_quietly)
    signal.signal(signal.SIGINT, _exit_quietly)
    forms = versions.Forms(versions.emulated_version())
    try:
        forms.at_least(versions.DEFAULT_VERSION)
    except ValueError:
        forms = versions.Forms(versions.DEFAULT_VERSION)  # load_profile below names the bad value
    ns = cli.build_parser(forms).parse_args(argv)
    configure_logging(ns.log_level)
    env = dict(os.environ)
    try:
        faults, profile = load_faults(env), load_profile(env)
    except EmulatorConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    started = time.monotonic()
    preload = _Preload()
    preload.start()

    args, model_config = cli.resolve(ns, env, gpu_memory_gb=profile.gpu_memory_gb, forms=forms)
    launch_args = dataclasses.replace(args)  # /server_info's top level: before the model runner writes back
    log.info(f"server_args={args.redacted_repr()}")
    gpu = gpu_id(env)
    if faults.describe() != "none":
        log.info(f"[emulator] injecting faults on GPU {gpu}: {faults.describe()}")
    alloc = allocation.compute(cli.allocation_inputs(args, model_config, profile.gpu_memory_gb),
                               mamba_full_memory_ratio=args.mamba_full_memory_ratio,
                               kv_tokens_override=faults.kv_tokens, mamba_slots_override=faults.max_mamba_slots)
    if alloc.mamba_slots is not None:
        args.max_mamba_cache_size = alloc.mamba_slots  # SGLang's model runner writes the sized value back
    timings = startup.load_model(args, model_config, alloc, faults, profile, forms)

    preload.join()
    if preload.error is not None:
        raise preload.error
    from dflash_regen.emulator.scheduler import Limits, Pace, Scheduler
    from dflash_regen.emulator.server import Emulator, serve

    decode, saturation = profile.decode_curve(args.speculative)  # the profile's rates are MTP-on ones
    scheduler = Scheduler(
        Limits(max_running_requests=alloc.effective_max_running_requests,
               max_queued_requests=args.max_queued_requests, max_total_num_tokens=alloc.max_total_num_tokens,
               mamba_slots=alloc.mamba_slots, mamba_ratio=alloc.mamba_ratio, hybrid=model_config.hybrid),
        Pace(decode_tokens_per_s=decode, prefill_tokens_per_s=profile.prefill_tokens_per_s,
             num_draft_tokens=args.speculative_num_draft_tokens if args.speculative else None,
             accept_length=profile.accept_length, saturation_tokens_per_s=saturation,
             decode_log_every_s=2.0 * max(args.decode_log_interval, 1) / 40),
        seed=sum(gpu.encode()))
    emu = Emulator(args=args, launch_args=launch_args, forms=forms, model=model_config, alloc=alloc, faults=faults,
                   profile=profile, gpu=gpu,
                   scheduler=scheduler, load_weights_s=timings["load_weights_s"],
                   startup_s=time.monotonic() - started)
    serve(emu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
