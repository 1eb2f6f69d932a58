"""The scheduler process: requests in, step plans to the worker(s), token deltas out."""

from __future__ import annotations

import logging
import os
import time

import zmq

from app import ipc, lifecycle
from app import protocol as p
from app.ipc import Endpoints
from app.scheduler.scheduler import AdmissionError, Scheduler, SchedulerConfig

log = logging.getLogger("tokenspeed.scheduler")


class SchedulerLoop:
    """Owns the sockets; one iteration = take inbox messages, run one step, publish deltas."""

    def __init__(self, settings, endpoints: Endpoints, ctx: zmq.Context) -> None:
        self.settings = settings
        self.inbox = ipc.bind_pull(ctx, endpoints.inbox("scheduler"))
        self.results = ipc.bind_pull(ctx, endpoints.inbox("scheduler_results"))
        self.to_worker = ipc.connect_push(ctx, endpoints.inbox("worker", 0))
        self.to_tokenizer = ipc.connect_push(ctx, endpoints.inbox("tokenizer"))
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.scheduler: Scheduler | None = None
        self.running = True
        self._decode_steps = 0
        self._log_window = (time.monotonic(), 0)  # (start, generated tokens) for throughput

    def wait_for_worker(self) -> p.WorkerReady:
        ready = ipc.recv(self.results)
        if not isinstance(ready, p.WorkerReady):
            raise RuntimeError(f"expected WorkerReady from the worker, got {type(ready).__name__}")
        s = self.settings
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=ready.num_blocks,
                block_size=ready.block_size,
                max_model_len=ready.max_model_len,
                max_num_seqs=s.max_num_seqs,
                chunked_prefill_size=s.chunked_prefill_size,
                max_prefill_tokens=s.max_prefill_tokens,
                enable_prefix_caching=s.enable_prefix_caching,
                eos_token_ids=tuple(ready.eos_token_ids),
            )
        )
        return ready

    def run(self) -> None:
        sched = self.scheduler
        assert sched is not None
        while self.running:
            timeout = 0 if sched.has_work() else 100
            for _ in range(1000):  # bounded: a flood of requests cannot stall the engine
                if not self.poller.poll(timeout):
                    break
                self.handle(ipc.recv(self.inbox))
                timeout = 0
            if not self.running:
                break
            plan = sched.schedule()
            if plan is None:
                continue
            ipc.send(self.to_worker, plan)
            result = ipc.recv(self.results)
            deltas = sched.process_result(result)
            if deltas:
                ipc.send(self.to_tokenizer, p.TokenDeltas(deltas))
            self._maybe_log(plan, deltas)

    def handle(self, msg) -> None:
        sched = self.scheduler
        assert sched is not None
        if isinstance(msg, p.TokenizedRequest):
            try:
                sched.add_request(msg)
            except AdmissionError as exc:
                self._reply_error(msg.rid, str(exc), 400)
        elif isinstance(msg, p.AbortRequest):
            deltas = sched.abort_all(msg.reason) if msg.abort_all else [sched.abort(msg.rid or "", msg.reason)]
            deltas = [d for d in deltas if d is not None]
            if deltas:
                ipc.send(self.to_tokenizer, p.TokenDeltas(deltas))
        elif isinstance(msg, p.FinishRequest):
            sched.finish(msg.rid)
        elif isinstance(msg, p.ControlRequest):
            ipc.send(self.to_tokenizer, self.control(msg))
        elif isinstance(msg, p.Shutdown):
            self.running = False
        else:
            log.warning("dropping unexpected message %s", type(msg).__name__)

    def control(self, msg: p.ControlRequest) -> p.ControlReply:
        sched = self.scheduler
        assert sched is not None
        if msg.kind == "flush_cache":
            n = sched.flush_cache()
            return p.ControlReply(msg.req_id, True, f"Cache flushed ({n} cached blocks dropped).")
        if msg.kind == "get_loads":
            return p.ControlReply(msg.req_id, True, "", sched.loads())
        return p.ControlReply(msg.req_id, False, f"unknown control operation {msg.kind!r}")

    def _reply_error(self, rid: str, message: str, code: int) -> None:
        delta = p.TokenDelta(rid=rid, token_ids=[], finish_reason=p.FINISH_ABORT, error=message, error_code=code)
        ipc.send(self.to_tokenizer, p.TokenDeltas([delta]))

    def _maybe_log(self, plan: p.StepPlan, deltas: list[p.TokenDelta]) -> None:
        interval = self.settings.decode_log_interval
        sched = self.scheduler
        assert sched is not None
        start, tokens = self._log_window
        tokens += sum(len(d.token_ids) for d in deltas)
        self._decode_steps += 1
        if interval > 0 and self._decode_steps % interval == 0:
            now = time.monotonic()
            log.info(
                "Decode batch. #running-req: %d, #queue-req: %d, KV usage: %.3f (%d/%d blocks, %d cached), "
                "gen throughput (token/s): %.1f",
                len(sched.running),
                len(sched.waiting),
                sched.kv.usage,
                sched.kv.num_used_blocks,
                sched.kv.num_blocks,
                sched.kv.num_cached_blocks,
                tokens / max(now - start, 1e-9),
            )
            self._log_window = (now, 0)
        else:
            self._log_window = (start, tokens)


def run_scheduler(settings, endpoints: Endpoints) -> None:
    """Process entry (multiprocessing spawn target)."""
    lifecycle.init_child("scheduler", settings.log_level)
    ctx = zmq.Context()
    loop = SchedulerLoop(settings, endpoints, ctx)
    lifecycle.on_sigterm(lambda: setattr(loop, "running", False))
    ready = loop.wait_for_worker()
    log.info(
        "KV pool: %d blocks of %d tokens = %d tokens; max concurrency at max_model_len %d: %.1f",
        ready.num_blocks,
        ready.block_size,
        ready.num_blocks * ready.block_size,
        ready.max_model_len,
        ready.num_blocks * ready.block_size / ready.max_model_len,
    )
    supervisor = ipc.connect_push(ctx, endpoints.inbox("supervisor"))
    ipc.send(supervisor, p.ProcessReady("scheduler", os.getpid(), {}))
    try:
        loop.run()
    finally:
        ctx.destroy(linger=0)
