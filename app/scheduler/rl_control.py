"""The RL control plane's scheduler side: pause/continue and weight updates, around the step loop.

Control operations arrive as ControlRequests (their op one of app/protocol.py's) from the HTTP front. Weight operations
run one at a time, in arrival order, on the worker, which replies with a ControlReply:

- A weight change (update_weights_from_disk / _distributed / _tensor, or start_weight_update) first
  drains the engine: admission closes, the running requests finish (new ones wait in the queue),
  then the worker swaps the weights and admission reopens. So every response comes from one
  version. If generation is paused (/pause_generation), there is nothing to wait for: the update
  runs at once and the paused requests continue on the new weights after /continue_generation;
  their KV then mixes versions, so none of their later blocks enters the prefix cache.
- start_weight_update ... finish_weight_update bracket a chunked (vLLM-style) update: between them
  the engine does not step, each chunk's weight_version and flush_cache are deferred, and
  finish_weight_update applies the version (its own, else the last chunk's) and flushes the prefix
  cache if any chunk asked for it.
- init_weights_update_group / destroy_weights_update_group only need the worker idle.

The weight version itself lives in the HTTP process; a reply's result is a WeightIdentity with the new
`weight_version` when the version changes (and `model_path` after a disk load), so every later response is
stamped with it. The worker gets the operation unchanged and ignores the scheduler's fields (weight_version,
flush_cache).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from app import protocol as p
from app.scheduler.scheduler import Scheduler

log = logging.getLogger("tokenspeed.scheduler")

WEIGHT_UPDATES = (p.UpdateWeightsFromDisk, p.UpdateWeightsFromDistributed, p.UpdateWeightsFromTensor)
GROUP_OPS = (p.InitWeightsUpdateGroup, p.DestroyWeightsUpdateGroup)
WORKER_OPS = WEIGHT_UPDATES + GROUP_OPS
SESSION_OPS = (p.StartWeightUpdate, p.FinishWeightUpdate)
QUEUED = WORKER_OPS + SESSION_OPS
EXCLUSIVE = (*WEIGHT_UPDATES, p.StartWeightUpdate)  # need the engine drained (or paused)
PAUSE_MODES = ("in_place", "retract", "abort")


@dataclass
class _Session:
    """An open chunked update: what finish_weight_update will apply."""

    weight_version: str | None = None
    flush: bool = False


class EngineControl:
    def __init__(
        self,
        sched: Scheduler,
        to_worker: Callable[[p.ControlRequest], None],
        reply: Callable[[p.ControlReply], None],
        emit: Callable[[list[p.TokenDelta]], None],
    ) -> None:
        self.sched = sched
        self._to_worker = to_worker
        self._reply = reply
        self._emit = emit
        self.paused = False
        self.session: _Session | None = None
        self._queue: deque[p.ControlRequest] = deque()
        self._at_worker: p.ControlRequest | None = None

    # ------------------------------------------------------------------ state

    @property
    def stepping_allowed(self) -> bool:
        return not self.paused and self._at_worker is None and self.session is None

    @property
    def waiting_for_worker(self) -> bool:
        return self._at_worker is not None

    @property
    def num_queued(self) -> int:
        """Operations waiting for their turn or running on the worker."""
        return len(self._queue) + (self._at_worker is not None)

    # ------------------------------------------------------------------ requests

    def handle(self, msg: p.ControlRequest) -> bool:
        """Take a control request this class owns; False if it is not one of them."""
        if isinstance(msg.op, p.PauseGeneration):
            self._pause(msg.req_id, msg.op)
        elif isinstance(msg.op, p.ContinueGeneration):
            self.paused = False
            self._reply(p.ControlReply(msg.req_id, True, "Continued generation."))
        elif isinstance(msg.op, QUEUED):
            self._queue.append(msg)
        else:
            return False
        return True

    def _pause(self, req_id: str, op: p.PauseGeneration) -> None:
        mode = op.mode
        if mode not in PAUSE_MODES:
            self._reply(p.ControlReply(req_id, False, f"unknown pause mode {mode!r}: use {PAUSE_MODES}"))
            return
        if mode == "abort":
            deltas = self.sched.abort_all("aborted by /pause_generation")
            if deltas:
                self._emit(deltas)
        elif mode == "retract":
            self.sched.retract_all()
        self.paused = True
        self._reply(p.ControlReply(req_id, True, "Paused generation."))

    # ------------------------------------------------------------------ progress

    def advance(self, steps_in_flight: int) -> None:
        """Start queued operations whose turn has come; call once per loop iteration."""
        while self._queue and self._at_worker is None:
            head = self._queue[0]
            if isinstance(head.op, EXCLUSIVE) and not self._drained(steps_in_flight):
                break
            if isinstance(head.op, GROUP_OPS) and steps_in_flight:
                break
            self._queue.popleft()
            self._start(head)
        pending = [*self._queue, self._at_worker] if self._at_worker is not None else list(self._queue)
        self.sched.admission_open = self.session is None and not any(isinstance(msg.op, EXCLUSIVE) for msg in pending)

    def _drained(self, steps_in_flight: int) -> bool:
        if steps_in_flight:
            return False
        return self.paused or self.session is not None or not self.sched.running

    def _start(self, msg: p.ControlRequest) -> None:
        if isinstance(msg.op, p.StartWeightUpdate):
            if self.session is not None:
                self._reply(p.ControlReply(msg.req_id, False, "a weight update is already in progress"))
            else:
                self.session = _Session()
                self._reply(p.ControlReply(msg.req_id, True, "Weight update started."))
        elif isinstance(msg.op, p.FinishWeightUpdate):
            self._finish_session(msg.req_id, msg.op)
        else:
            self._at_worker = msg
            self._to_worker(msg)

    def _finish_session(self, req_id: str, op: p.FinishWeightUpdate) -> None:
        session = self.session
        if session is None:
            self._reply(p.ControlReply(req_id, False, "no weight update in progress: call /start_weight_update first"))
            return
        self.session = None
        version = op.weight_version or session.weight_version
        message = "Weight update finished."
        if session.flush:
            self.sched.flush_cache()
            message += " Prefix cache flushed."
        self._reply(p.ControlReply(req_id, True, _with_version(message, version), p.WeightIdentity(version)))

    def on_worker_reply(self, reply: p.ControlReply) -> None:
        msg = self._at_worker
        if msg is None or reply.req_id != msg.req_id:
            log.warning("dropping an unexpected control reply from the worker (%s)", reply.req_id)
            return
        self._at_worker = None
        op = msg.op
        if not reply.success or not isinstance(op, WEIGHT_UPDATES):
            self._reply(reply)
            return
        self.sched.mark_running_stale()
        flush = isinstance(op, p.UpdateWeightsFromDisk) or op.flush_cache
        version = op.weight_version or None
        if self.session is not None:
            self.session.flush |= flush
            self.session.weight_version = version or self.session.weight_version
            self._reply(p.ControlReply(reply.req_id, True, reply.message + " Weight version and cache flush "
                                       "are deferred to /finish_weight_update."))
            return
        message = reply.message
        if flush:
            self.sched.flush_cache()
            message += " Prefix cache flushed."
        path = op.model_path if isinstance(op, p.UpdateWeightsFromDisk) else None
        self._reply(p.ControlReply(reply.req_id, True, _with_version(message, version), p.WeightIdentity(version, path)))


def _with_version(message: str, version: str | None) -> str:
    return f"{message} Weight version updated to {version}." if version else message
