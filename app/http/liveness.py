"""The HTTP process's part in liveness: it beats its own heartbeat from the event loop (a blocked loop
stops it, and the supervisor then declares http wedged), and it reads the engine processes' heartbeats
so that readiness turns 503 as soon as one of them stops reporting, well before the supervisor's
timeout brings the appliance down."""

from __future__ import annotations

import asyncio
import glob
import os
from collections.abc import Callable

from app.lifecycle import HEARTBEAT_INTERVAL_S, Heartbeat

READINESS_STALE_S = 10.0  # silent this long (or half its heartbeat timeout, if less): not ready
ENGINE_PROCESSES = ("tokenizer", "scheduler*", "worker*")


async def beat_forever(heartbeat: Heartbeat) -> None:
    while True:
        heartbeat.beat()
        await asyncio.sleep(HEARTBEAT_INTERVAL_S)


def engine_heartbeats(runtime_dir: str) -> dict[str, Heartbeat]:
    """The heartbeats the supervisor made for the engine processes (none when http runs alone)."""
    # Data-parallel replicas and TP ranks multiply the schedulers and workers (app/topology.py).
    names = sorted(os.path.basename(p).removeprefix("heartbeat-")
                   for pattern in ENGINE_PROCESSES for p in glob.glob(Heartbeat.path_of(runtime_dir, pattern)))
    beats = {name: Heartbeat.attach(runtime_dir, name) for name in names}
    return {name: beat for name, beat in beats.items() if beat is not None}


def liveness_check(heartbeats: dict[str, Heartbeat], heartbeat_timeout: float,
                   worker_heartbeat_timeout: float) -> Callable[[], str | None]:
    """A function that says why the engine cannot serve now (a process gone silent), or None."""
    def stale_after(name: str) -> float:
        timeout = worker_heartbeat_timeout if name.startswith("worker") else heartbeat_timeout
        return min(READINESS_STALE_S, timeout / 2)

    def problem() -> str | None:
        for name, heartbeat in heartbeats.items():
            age = heartbeat.age()
            if age > stale_after(name):
                return f"the {name} process has not reported for {age:.1f} s"
        return None

    return problem
