"""`tokenspeed warmup [MODEL] [serve flags]`: build the kernels a start with these arguments needs into the
kernel caches, so that `serve` compiles nothing.

It runs one worker's start-up in this process (dummy weights: kernels depend on shapes, not values) with
flashinfer's JIT builds allowed, which `serve` never does (app/worker/attention/selection.py): flashinfer's
attention kernels land in FLASHINFER_WORKSPACE_BASE (nvcc needed), and every Triton kernel that the
memory profile, the CUDA-graph captures and the warm-up step launch lands in TRITON_CACHE_DIR. Run it
where the caches live (the kernel-cache volume) on the GPU model that will serve.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from app import lifecycle, model_files
from app.config.cli_args import build_parser, parse_command_line
from app.config.loader import resolve
from app.config.settings import Settings

PROG = "tokenspeed warmup"
log = logging.getLogger("tokenspeed.warmup")


def run(argv: Sequence[str]) -> int:
    """Exit 0 once every kernel is built; 1 with one line if the model or the device cannot be had."""
    parser = build_parser(PROG)
    parser.description = ("Build the kernels `tokenspeed serve` with the same arguments needs into the kernel "
                          "caches (TRITON_CACHE_DIR, FLASHINFER_WORKSPACE_BASE). " + (parser.description or ""))
    settings = resolve(parse_command_line(argv, parser)).settings
    if settings.tensor_parallel_size > 1:
        print(f"tokenspeed: error: {PROG} builds one GPU's kernels; --tensor-parallel-size "
              f"{settings.tensor_parallel_size} ranks have other shapes: run it with --tensor-parallel-size 1 "
              "for now, or let the first serve build them", file=sys.stderr)
        return 1
    settings = settings.model_copy(update={"load_format": "dummy"})
    lifecycle.configure_logging(settings.log_level, "warmup")
    started = time.perf_counter()
    try:
        model_files.prepare(settings)  # the config only (dummy weights)
        seconds = _build(settings)
    except (ValueError, RuntimeError) as exc:  # ModelUnavailable is a ValueError
        log.error("%s", exc, exc_info=settings.log_level == "debug")
        return 1
    log.info("kernels built in %.1f s (%s); caches: %s", time.perf_counter() - started,
             ", ".join(f"{phase} {s:.1f} s" for phase, s in seconds.items()), cache_report())
    return 0


def _build(settings: Settings) -> dict[str, float]:
    import torch

    from app.startup_phases import StartupClock
    from app.worker.model_runner import ModelRunner
    from app.worker.process import resolve_device

    device = resolve_device(settings.device, settings.base_gpu_id)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with torch.inference_mode():
        runner = ModelRunner(settings, device, clock=StartupClock("warmup"), build_kernels=True)
        runner.warmup()
    log.info("attention backend %s (decode kernel %s)", runner.attention.name, runner.attention.decode_kernel_name())
    return dict(runner.clock.seconds)


def cache_report() -> str:
    """Each kernel cache's path and size, for the log."""
    flashinfer = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE") or Path.home()) / ".cache" / "flashinfer"
    caches = {"triton": Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache"),
              "flashinfer": flashinfer}
    return ", ".join(f"{name} {path} ({_size_mb(path):.0f} MB)" for name, path in caches.items())


def _size_mb(path: Path) -> float:
    if not path.is_dir():
        return 0.0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6
