"""Start-up phases made visible: each phase's start and end in the log with elapsed seconds, a line at
least every TICK_S while one runs (a silent container looks hung), and each change sent on as a
`StartupPhase` message so /readiness can say where start-up is.

A process walks its phases in order with `enter(phase)`, which ends the one before; `done()` ends the
last. The worker's are PHASES minus download (the supervisor's), the order they run in.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from app.protocol import StartupPhase

log = logging.getLogger("tokenspeed.startup")

# In start-up order. init: a worker's imports, device and TP group; kernels: the attention backend's
# kernels probed and loaded (flashinfer's JIT cache); memory_profile: a profiled step and the KV pool
# sized from what is left; graph_capture: CUDA graphs.
PHASES = ("download", "init", "weights", "kernels", "memory_profile", "graph_capture", "warmup")
TICK_S = 5.0  # the longest stretch a running phase goes without a log line


class StartupClock:
    """One process's start-up phases: timed, logged, and reported through `report` (if given)."""

    def __init__(self, process: str, report: Callable[[StartupPhase], None] | None = None,
                 tick_s: float = TICK_S) -> None:
        self.process = process
        self.report = report
        self.tick_s = tick_s
        self.seconds: dict[str, float] = {}  # finished phases, in the order they ran
        self.current: str | None = None
        self.detail = ""  # progress of the running phase (e.g. the weights' percentage), for the ticks
        self._started = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def enter(self, phase: str) -> None:
        """End the running phase (if any) and start `phase`."""
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}; one of {', '.join(PHASES)}")
        self._end()
        with self._lock:
            self.current, self.detail, self._started = phase, "", time.perf_counter()
        log.info("start-up phase %s: started", phase)
        self._send(StartupPhase(self.process, phase, 0.0, False))
        if self._ticker is None and self.tick_s > 0:
            self._ticker = threading.Thread(target=self._tick, name="startup-ticker", daemon=True)
            self._ticker.start()

    def progress(self, detail: str) -> None:
        """What the running phase has done so far; the next tick line shows it."""
        self.detail = detail

    def done(self) -> dict[str, float]:
        """End the running phase and stop ticking; returns every phase's seconds."""
        self._end()
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        return dict(self.seconds)

    def _end(self) -> None:
        with self._lock:
            phase, self.current = self.current, None
            if phase is None:
                return
            seconds = time.perf_counter() - self._started
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        log.info("start-up phase %s: done in %.1f s", phase, seconds)
        self._send(StartupPhase(self.process, phase, seconds, True))

    def _tick(self) -> None:
        while not self._stop.wait(self.tick_s):
            with self._lock:
                phase, since, detail = self.current, self._started, self.detail
            if phase is not None:
                log.info("start-up phase %s: running for %.0f s%s", phase, time.perf_counter() - since,
                         f" ({detail})" if detail else "")

    def _send(self, msg: StartupPhase) -> None:
        if self.report is not None:
            try:
                self.report(msg)
            except Exception as exc:  # noqa: BLE001 - a lost progress note must not stop the start
                log.debug("start-up phase report failed: %r", exc)


def summary(seconds: dict[str, float]) -> str:
    """`download 0.0 s, weights 3.1 s, ...` in phase order, for the supervisor's ready line."""
    ordered = [p for p in PHASES if p in seconds] + [p for p in seconds if p not in PHASES]
    return ", ".join(f"{p} {seconds[p]:.1f} s" for p in ordered)


def slowest(phases: dict[str, str]) -> str | None:
    """Of the processes' current phases, the earliest in start-up order: the one readiness waits on."""
    if not phases:
        return None
    return min(phases.values(), key=lambda p: PHASES.index(p) if p in PHASES else len(PHASES))


class StartupProgress:
    """What http knows of start-up, from the StartupPhase messages: each process's current phase and
    the seconds of the phases finished (the slowest process's figure when several ran one)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.current: dict[str, str] = {}
        self.seconds: dict[str, float] = {}

    def apply(self, msg: StartupPhase) -> None:
        if msg.done:
            self.seconds[msg.phase] = max(self.seconds.get(msg.phase, 0.0), round(msg.seconds, 3))
        else:
            self.current[msg.name] = msg.phase

    def as_json(self) -> dict:
        """{"phase": where start-up is, "processes": {name: phase}, "phase_seconds": {phase: s},
        "elapsed_seconds": since http started}; phase is "starting" before any process reports one."""
        return {
            "phase": slowest(self.current) or "starting",
            "processes": dict(self.current),
            "phase_seconds": dict(self.seconds),
            "elapsed_seconds": round(time.monotonic() - self.started, 1),
        }
