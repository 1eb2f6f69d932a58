"""ZMQ plumbing shared by every process: endpoint names and socket constructors.

Each process binds the PULL socket it reads from (its inbox) and connects PUSH sockets to the
inboxes of the processes it writes to. Endpoints are ipc:// files in the private runtime dir.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import zmq

from app import protocol

# Inboxes, one per reader. The scheduler reads two: requests/control, and worker results.
INBOXES = ("supervisor", "http", "tokenizer", "scheduler", "scheduler_results", "worker")
# One of these per data-parallel replica (the worker inbox is its TP leader's; app/topology.py).
PER_REPLICA = ("scheduler", "scheduler_results", "worker")


@dataclass(frozen=True)
class Endpoints:
    """The ipc:// addresses of every inbox, derived from the runtime dir."""

    runtime_dir: str

    def inbox(self, name: str, replica: int = 0) -> str:
        if name not in INBOXES:
            raise KeyError(f"unknown inbox {name!r}")
        suffix = f"_{replica}" if name in PER_REPLICA else ""
        return f"ipc://{os.path.join(self.runtime_dir, name + suffix)}.sock"


def bind_pull(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(address)
    return sock


def connect_push(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)  # let the last messages out on close
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(address)
    return sock


def send(sock: zmq.Socket, msg: Any) -> None:
    sock.send(protocol.encode(msg), copy=False)


def recv(sock: zmq.Socket, flags: int = 0) -> Any:
    return protocol.decode(sock.recv(flags))


async def recv_async(sock: Any) -> Any:
    """recv on a zmq.asyncio socket."""
    return protocol.decode(await sock.recv())
