"""A real uvicorn serving an ASGI app on a free port, in a daemon thread, for the duration of a `with`."""

from __future__ import annotations

import threading
from typing import Any

import uvicorn


class ThreadedServer:
    def __init__(self, app: Any, lifespan: str = "on") -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan=lifespan, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = ""

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        for _ in range(500):
            if self.server.started:
                break
            self.thread.join(0.01)
        assert self.server.started, "uvicorn did not start"
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)
