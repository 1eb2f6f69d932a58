"""The scheduler process: requests in, step plans to the worker(s), token deltas out."""

from __future__ import annotations

import logging
import os
import time

import zmq

from app import ipc, lifecycle
from app import protocol as p
from app.config.kv_events import parse_kv_events_config
from app.config.settings import Settings
from app.ipc import Endpoints
from app.metrics.kv_events import KVEventPublisher, KVEventRecorder
from app.metrics.request_stats import FinishLogger
from app.scheduler.rl_control import EngineControl
from app.scheduler.scheduler import AdmissionError, QueueFull, Scheduler, SchedulerConfig
from app.topology import Topology

log = logging.getLogger("tokenspeed.scheduler")

EXPIRY_CHECK_S = 0.1  # how often request timeouts are checked
WAIT_POLL_MS = int(lifecycle.HEARTBEAT_INTERVAL_S * 1000)  # beat while a long step runs on the worker

MAX_INFLIGHT_STEPS = 2  # overlap depth: the step running on the worker plus the next one
CONTROL_POLL_MS = 10  # inbox wait while the worker runs a control operation (its reply comes on results)


class SchedulerLoop:
    """Owns the sockets; one iteration = take inbox messages, run one step, publish deltas."""

    def __init__(self, settings: Settings, endpoints: Endpoints, ctx: zmq.Context, replica: int = 0) -> None:
        self.settings = settings
        self.ctx = ctx
        self.replica = replica  # the data-parallel replica this scheduler drives (app/topology.py)
        self.name = Topology.from_settings(settings).scheduler_name(replica)
        self.inbox = ipc.bind_pull(ctx, endpoints.inbox("scheduler", replica))
        self.results = ipc.bind_pull(ctx, endpoints.inbox("scheduler_results", replica))
        self.to_worker = ipc.connect_push(ctx, endpoints.inbox("worker", replica))
        self.to_tokenizer = ipc.connect_push(ctx, endpoints.inbox("tokenizer"))
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.scheduler: Scheduler | None = None
        self.running = True
        self.heartbeat = lifecycle.Heartbeat.attach(endpoints.runtime_dir, self.name)
        self._next_expiry = 0.0
        self._decode_steps = 0
        self._log_window = (time.monotonic(), 0)  # (start, generated tokens) for throughput
        self.engine_control: EngineControl | None = None
        self.metrics = None  # app.metrics.engine.EngineMetrics with --enable-metrics
        self.kv_events: KVEventRecorder | None = None
        self.publisher: KVEventPublisher | None = None
        self.max_inflight = MAX_INFLIGHT_STEPS

    def wait_for_worker(self) -> p.WorkerReady | None:
        """The worker's WorkerReady; None if told to stop first (a start-up failure elsewhere: the wait
        polls, so SIGTERM ends it at once instead of the supervisor's kill after its grace period)."""
        while not self.results.poll(WAIT_POLL_MS):
            lifecycle.beat(self.heartbeat)
            if not self.running:
                return None
        ready = ipc.recv(self.results)
        if not isinstance(ready, p.WorkerReady):
            raise RuntimeError(f"expected WorkerReady from the worker, got {type(ready).__name__}")
        s = self.settings
        events_config = parse_kv_events_config(s.kv_events_config)
        if events_config is not None:
            self.kv_events = KVEventRecorder(ready.block_size)
            self.publisher = KVEventPublisher(events_config, self.ctx, dp_rank=self.replica)
        self.scheduler = Scheduler(SchedulerConfig.from_settings(s, ready), kv_events=self.kv_events)
        if self.scheduler.config.num_speculative_tokens:
            # A verify step's accepted count sets every length and position of the next step: it is
            # planned after the result, one step at the worker (docs/speculative.md).
            self.max_inflight = 1
            log.info("speculative decoding (%s, %d draft tokens): one step in flight, the overlap of "
                     "planning with the forward is off", s.speculative_algorithm, s.speculative_num_steps)
        self._observe_with(self.scheduler)
        return ready

    def _observe_with(self, sched: Scheduler) -> None:
        """Request stats, metrics and the RL control plane around the scheduler."""
        s = self.settings
        sched.on_finish = FinishLogger(s.enable_log_request_stats, bool(sched.config.num_speculative_tokens))
        sched.track_delays = s.enable_log_request_stats
        if s.enable_metrics:
            from app.metrics.engine import EngineMetrics

            self.metrics = EngineMetrics(sched, s.served_model_name, dp_rank=self.replica)
        self.engine_control = EngineControl(
            sched,
            to_worker=lambda msg: ipc.send(self.to_worker, msg),
            reply=lambda msg: ipc.send(self.to_tokenizer, msg),
            emit=self._send_deltas,
        )

    def _send_deltas(self, deltas: list[p.TokenDelta]) -> None:
        ipc.send(self.to_tokenizer, p.TokenDeltas(deltas, time.time()))

    def _observe(self) -> None:
        """Once per loop iteration: gauges and counters, this iteration's KV events, replay requests."""
        if self.metrics is not None:
            self.metrics.update()
        if self.publisher is not None:
            assert self.kv_events is not None
            if len(self.kv_events):
                self.publisher.publish(self.kv_events.take())
            self.publisher.serve_replay()

    def _poll_control_reply(self) -> None:
        """While the worker runs a control operation (no step is in flight), take its reply."""
        control = self.engine_control
        assert control is not None
        if control.waiting_for_worker and self.results.poll(0):
            msg = ipc.recv(self.results)
            if isinstance(msg, p.ControlReply):
                control.on_worker_reply(msg)
            else:
                log.warning("dropping unexpected %s while waiting for a control reply", type(msg).__name__)

    def run(self) -> None:
        """Keep up to MAX_INFLIGHT_STEPS steps at the worker: step N+1 is planned and sent while
        step N runs, so scheduling, IPC and detokenization overlap the forward pass."""
        sched, control = self.scheduler, self.engine_control
        assert sched is not None and control is not None
        try:
            while self.running:
                lifecycle.beat(self.heartbeat)
                busy = sched.num_inflight_steps or (control.stepping_allowed and sched.has_work())
                self._drain_inbox(timeout_ms=CONTROL_POLL_MS if control.waiting_for_worker else 0 if busy else 100)
                if not self.running:
                    break
                self._expire()
                self._poll_control_reply()
                control.advance(sched.num_inflight_steps)
                while control.stepping_allowed and sched.num_inflight_steps < self.max_inflight:
                    plan = sched.schedule()
                    if plan is None:
                        break
                    ipc.send(self.to_worker, plan)
                    if self.metrics is not None:
                        self.metrics.planned(sched.last_step_tokens)
                if sched.num_inflight_steps:
                    result = self._wait_result()
                    if result is None:
                        break
                    deltas = sched.process_result(result)
                    if deltas:
                        self._send_deltas(deltas)
                    self._maybe_log(deltas)
                self._observe()
        finally:
            if self.publisher is not None:
                self.publisher.close()

    def _wait_result(self) -> p.StepResult | None:
        """The worker's next result, beating the heartbeat while it computes; None once stopping."""
        while not self.results.poll(WAIT_POLL_MS):
            lifecycle.beat(self.heartbeat)
            if not self.running:
                return None
        return ipc.recv(self.results)

    def _expire(self) -> None:
        now = time.monotonic()
        if now < self._next_expiry:
            return
        self._next_expiry = now + EXPIRY_CHECK_S
        sched = self.scheduler
        assert sched is not None
        deltas = sched.expire(time.time())
        if deltas:
            log.warning("%d request(s) timed out: %s", len(deltas), deltas[0].error)
            self._send_deltas(deltas)

    def _drain_inbox(self, timeout_ms: int) -> None:
        for _ in range(1000):  # bounded: a flood of requests cannot stall the engine
            if not self.poller.poll(timeout_ms):
                return
            self.handle(ipc.recv(self.inbox))
            timeout_ms = 0

    def handle(self, msg) -> None:
        sched = self.scheduler
        assert sched is not None
        if isinstance(msg, p.TokenizedRequest):
            try:
                sched.add_request(msg)
            except AdmissionError as exc:
                self._reply_error(msg.rid, str(exc), 400)
            except QueueFull as exc:
                self._reply_error(msg.rid, str(exc), 503)
        elif isinstance(msg, p.AbortRequest):
            deltas = sched.abort_all(msg.reason) if msg.abort_all else [sched.abort(msg.rid or "", msg.reason)]
            deltas = [d for d in deltas if d is not None]
            if deltas:
                ipc.send(self.to_tokenizer, p.TokenDeltas(deltas))
        elif isinstance(msg, p.FinishRequest):
            sched.finish(msg.rid)
        elif isinstance(msg, p.ControlRequest):
            assert self.engine_control is not None
            if not self.engine_control.handle(msg):  # weight updates, pause and continue answer later
                ipc.send(self.to_tokenizer, self.control(msg))
        elif isinstance(msg, p.Shutdown):
            self.running = False
        else:
            log.warning("dropping unexpected message %s", type(msg).__name__)

    def control(self, msg: p.ControlRequest) -> p.ControlReply:
        sched = self.scheduler
        assert sched is not None
        if isinstance(msg.op, p.FlushCache):
            n = sched.flush_cache()
            return p.ControlReply(msg.req_id, True, f"Cache flushed ({n} cached blocks dropped).")
        if isinstance(msg.op, p.GetLoads):
            assert self.engine_control is not None
            control = self.engine_control
            loads = p.Loads(self.replica, **sched.loads(), paused=control.paused,
                            weight_update_in_progress=control.session is not None, queued_control_ops=control.num_queued)
            return p.ControlReply(msg.req_id, True, "", loads)
        return p.ControlReply(msg.req_id, False, f"unknown control operation {msg.kind!r}")

    def _reply_error(self, rid: str, message: str, code: int) -> None:
        delta = p.TokenDelta(rid=rid, token_ids=[], finish_reason=p.FINISH_ABORT, error=message, error_code=code)
        ipc.send(self.to_tokenizer, p.TokenDeltas([delta]))

    def _maybe_log(self, deltas: list[p.TokenDelta]) -> None:
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


def run_scheduler(settings: Settings, endpoints: Endpoints, replica: int = 0) -> None:
    """Process entry (multiprocessing spawn target)."""
    name = Topology.from_settings(settings).scheduler_name(replica)
    lifecycle.init_child(name, settings.log_level)
    ctx = zmq.Context()
    loop = SchedulerLoop(settings, endpoints, ctx, replica)
    lifecycle.on_sigterm(lambda: setattr(loop, "running", False))
    ready = loop.wait_for_worker()
    if ready is None:
        ctx.destroy(linger=0)
        return
    log.info(
        "KV pool: %d blocks of %d tokens = %d tokens; max concurrency at max_model_len %d: %.1f",
        ready.num_blocks,
        ready.block_size,
        ready.num_blocks * ready.block_size,
        ready.max_model_len,
        ready.num_blocks * ready.block_size / ready.max_model_len,
    )
    supervisor = ipc.connect_push(ctx, endpoints.inbox("supervisor"))
    lifecycle.settle_heap()
    ipc.send(supervisor, p.ProcessReady(name, os.getpid(), {}))
    try:
        loop.run()
    finally:
        ctx.destroy(linger=0)
