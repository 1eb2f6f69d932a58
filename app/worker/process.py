"""The worker process: owns the device, executes the scheduler's step plans."""

from __future__ import annotations

import logging
import os
import traceback

import zmq

from app import ipc, lifecycle
from app import protocol as p
from app.ipc import Endpoints

log = logging.getLogger("tokenspeed.worker")


def resolve_device(setting: str):
    import torch

    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA GPU is visible (check --gpus / nvidia runtime)")
    return torch.device(setting)


def run_worker(settings, endpoints: Endpoints, rank: int = 0) -> None:
    """Process entry (multiprocessing spawn target)."""
    lifecycle.init_child(f"worker{rank}", settings.log_level)
    import torch

    from app.worker.model_runner import ModelRunner

    device = resolve_device(settings.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    runner = ModelRunner(settings, device, rank)
    runner.warmup()
    ready = runner.ready_message()
    log.info("worker %d ready on %s: %s", rank, device, ready.info)

    ctx = zmq.Context()
    inbox = ipc.bind_pull(ctx, endpoints.inbox("worker", rank))
    results = ipc.connect_push(ctx, endpoints.inbox("scheduler_results"))
    supervisor = ipc.connect_push(ctx, endpoints.inbox("supervisor"))
    ipc.send(results, ready)
    engine_info = {
        **ready.info,
        "num_blocks": ready.num_blocks,
        "block_size": ready.block_size,
        "max_model_len": ready.max_model_len,
        "vocab_size": ready.vocab_size,
        "eos_token_ids": ready.eos_token_ids,
    }
    ipc.send(supervisor, p.ProcessReady(f"worker{rank}", os.getpid(), engine_info))
    lifecycle.on_sigterm(lambda: os._exit(0))  # nothing to flush: device state dies with us
    try:
        with torch.inference_mode():
            serve_steps(runner, inbox, results)
    finally:
        ctx.destroy(linger=0)


def serve_steps(runner, inbox: zmq.Socket, results: zmq.Socket) -> None:
    while True:
        msg = ipc.recv(inbox)
        if isinstance(msg, p.Shutdown):
            return
        if not isinstance(msg, p.StepPlan):
            log.warning("dropping unexpected message %s", type(msg).__name__)
            continue
        try:
            result = runner.execute(msg)
        except Exception as exc:  # a failed step fails its requests, not the appliance
            log.error("step %d failed:\n%s", msg.step, traceback.format_exc())
            result = p.StepResult(step=msg.step, error=f"{type(exc).__name__}: {exc}")
        ipc.send(results, result)
