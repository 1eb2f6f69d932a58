"""The HTTP process's part in liveness: it beats its own heartbeat from the event loop (a blocked loop
stops it, and the supervisor then declares http wedged), and it reads the engine processes' heartbeats
so that readiness turns 503 as soon as one of them stops reporting, well before the supervisor's
timeout brings the appliance down."""

from __future__ import annotations

import asyncio
import glob
import os

from app.config.settings import Settings
from app.lifecycle import HEARTBEAT_INTERVAL_S, Heartbeat, HeartbeatWatch

READINESS_STALE_S = 10.0  # silent this long (or half its heartbeat timeout, if less): not ready
ENGINE_PROCESSES = ("tokenizer", "scheduler*", "worker*")


async def beat_forever(heartbeat: Heartbeat | None, liveness: EngineLiveness) -> None:
    """http's own beat, and a look at the engine's heartbeats, every interval."""
    while True:
        if heartbeat is not None:
            heartbeat.beat()
        liveness.look()
        await asyncio.sleep(HEARTBEAT_INTERVAL_S)


def engine_heartbeats(runtime_dir: str) -> dict[str, Heartbeat]:
    """The heartbeats the supervisor made for the engine processes (none when http runs alone)."""
    # Data-parallel replicas and TP ranks multiply the schedulers and workers (app/topology.py).
    names = sorted(os.path.basename(p).removeprefix("heartbeat-")
                   for pattern in ENGINE_PROCESSES for p in glob.glob(Heartbeat.path_of(runtime_dir, pattern)))
    beats = {name: Heartbeat.attach(runtime_dir, name) for name in names}
    return {name: beat for name, beat in beats.items() if beat is not None}


class EngineLiveness:
    """http's view of the engine processes' heartbeats. Watching starts at the first question, which
    readiness asks only once the engine is ready (a start-up spent loading weights is not silence);
    http's beat loop looks every interval after that, so silence is timed between probes too."""

    def __init__(self, heartbeats: dict[str, Heartbeat], heartbeat_timeout: float,
                 worker_heartbeat_timeout: float) -> None:
        def stale_after(name: str) -> float:
            timeout = worker_heartbeat_timeout if name.startswith("worker") else heartbeat_timeout
            return min(READINESS_STALE_S, timeout / 2)

        self._heartbeats = heartbeats
        self._stale_after = {name: stale_after(name) for name in heartbeats}
        self._watches: dict[str, HeartbeatWatch] | None = None

    @classmethod
    def of(cls, runtime_dir: str, settings: Settings) -> EngineLiveness:
        return cls(engine_heartbeats(runtime_dir), settings.heartbeat_timeout, settings.worker_heartbeat_timeout)

    def look(self) -> None:
        for watch in (self._watches or {}).values():
            watch.silent_for()

    def problem(self) -> str | None:
        """Why the engine cannot serve now (a process gone silent), or None."""
        if self._watches is None:
            self._watches = {name: HeartbeatWatch(beat) for name, beat in self._heartbeats.items()}
        for name, watch in self._watches.items():
            silent = watch.silent_for()
            if silent > self._stale_after[name]:
                return f"the {name} process has not reported for {silent:.1f} s"
        return None
