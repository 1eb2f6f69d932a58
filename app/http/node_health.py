"""The HTTP process of a worker node (--node-rank > 0): health only; node 0 serves the API.

/health and /liveness answer while the process runs. /readiness and /health_generate answer 200 once
every worker of this node has started (the supervisor's EngineReady) while their heartbeats are fresh,
else 503, so an orchestrator can probe every node the same way. The supervisor's Shutdown (a child
failed) or SIGTERM stops it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

import uvicorn
import zmq
import zmq.asyncio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from app import ipc, lifecycle
from app import protocol as p
from app.config.settings import Settings
from app.http.liveness import EngineLiveness, beat_forever
from app.ipc import Endpoints
from app.lifecycle import Heartbeat

log = logging.getLogger(__name__)


class NodeState:
    def __init__(self, node_rank: int, problem: Any) -> None:
        self.node_rank = node_rank
        self.ready = False
        self.problem = problem  # () -> why the workers cannot serve (a stale heartbeat), or None

    def unready_reason(self) -> str | None:
        return "not ready" if not self.ready else self.problem()


def build_node_app(state: NodeState) -> Starlette:
    async def health(request: Request) -> Response:
        return PlainTextResponse("OK")

    async def readiness(request: Request) -> Response:
        reason = state.unready_reason()
        body: dict[str, Any] = {"node_rank": state.node_rank, "role": "worker node"}
        if reason is None:
            return JSONResponse({"status": "ready", **body})
        return JSONResponse({"status": "not ready", "reason": reason, **body}, status_code=503)

    routes = [Route("/health", health), Route("/liveness", health), Route("/readiness", readiness),
              Route("/health_generate", readiness)]
    return Starlette(routes=routes)


def run_node_health(settings: Settings, endpoints: Endpoints) -> None:
    lifecycle.init_child("http", settings.log_level)
    asyncio.run(_serve(settings, endpoints))


async def _serve(settings: Settings, endpoints: Endpoints) -> None:
    liveness = EngineLiveness.of(endpoints.runtime_dir, settings)
    state = NodeState(settings.node_rank, liveness.problem)
    server = uvicorn.Server(uvicorn.Config(build_node_app(state), host=settings.host, port=settings.port,
                                           log_config=None, access_log=False))
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: setattr(server, "should_exit", True))
    tasks = [asyncio.create_task(beat_forever(Heartbeat.attach(endpoints.runtime_dir, "http"), liveness))]
    ctx = zmq.asyncio.Context()
    inbox = ipc.bind_pull(ctx, endpoints.inbox("http"))
    tasks.append(asyncio.create_task(_follow_supervisor(inbox, state, server)))
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:
        push = ctx.socket(zmq.PUSH)
        push.connect(endpoints.inbox("supervisor"))
        await push.send(p.encode(p.ProcessReady("http", os.getpid(), {"port": settings.port})))
        push.close(linger=1000)
        log.info("node %d health on %s:%d", settings.node_rank, settings.host, settings.port)
    await serving
    for task in tasks:
        task.cancel()
    ctx.destroy(linger=0)


async def _follow_supervisor(inbox: zmq.asyncio.Socket, state: NodeState, server: uvicorn.Server) -> None:
    while True:
        msg = await ipc.recv_async(inbox)
        if isinstance(msg, p.EngineReady):
            state.ready = True
        elif isinstance(msg, p.Shutdown):
            log.error("stopping: %s", msg.reason)
            server.should_exit = True
