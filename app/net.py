"""Host networking helpers shared by the supervisor and the workers (so no child imports the supervisor)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on this host now (the workers bind it moments later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
