"""GET /metrics: every process's metrics in the Prometheus text format.

With --enable-metrics the supervisor points PROMETHEUS_MULTIPROC_DIR at a fresh directory in its
private runtime dir before it starts any child (each child imports prometheus_client after that, so
every metric writes to that directory); this route merges the files of all processes at each scrape.
Without the variable (a process run on its own, e.g. in tests) the process's default registry is
served instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.metrics.catalog import build

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def prepare_multiprocess_dir(runtime_dir: str) -> str:
    """Create <runtime_dir>/prometheus and export it for the children (call before starting them).
    Any value inherited from the environment is replaced: stale files would corrupt the counters."""
    path = os.path.join(runtime_dir, "prometheus")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.environ[MULTIPROC_ENV] = path
    return path


def exposition() -> tuple[bytes, str]:
    """(body, content type) of a scrape."""
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    if os.environ.get(MULTIPROC_ENV):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


class StartupMetrics:
    """tokenspeed:startup_time_seconds{phase} from the engine's start-up phases (EngineReady's figures)
    and their "total" (the supervisor's startup_seconds). Recorded once, when known."""

    def __init__(self, model_name: str, registry: Any = None) -> None:
        self._gauge = build(("startup_time_seconds",), registry)["startup_time_seconds"]
        self._model = model_name
        self.recorded = False

    def record(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self._gauge.labels(model_name=self._model, phase=phase).set(float(seconds))
        self.recorded = True


def metrics_route(model_name: str, startup_phases: Callable[[], dict[str, float] | None]) -> Route:
    """The /metrics route; startup_phases returns the engine's start-up phases once it is ready."""
    startup = StartupMetrics(model_name)

    async def metrics(request: Request) -> Response:
        if not startup.recorded and (phases := startup_phases()) is not None:
            startup.record(phases)
        body, content_type = exposition()
        return Response(body, media_type=content_type)

    return Route("/metrics", metrics, methods=["GET"])
