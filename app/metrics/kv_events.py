"""KV cache events: prefix-cache blocks stored and removed, published on a ZMQ PUB socket.

Configured by --kv-events-config (KVEventsConfig). The scheduler's KVCacheManager reports each block
it registers in the prefix cache (BlockStored) and each one it evicts or flushes (BlockRemoved) to a
KVEventRecorder; once per scheduler step the recorded events go out as one batch:

    frames: [topic bytes, sequence number (8 bytes, big-endian, from 0), msgpack payload]
    payload: [timestamp, [event, ...], attn_dp_rank]
    event:   ["BlockStored", [block_hash], parent_hash | None, token_ids, block_size]
             ["BlockRemoved", [block_hash]]

Block hashes (app/scheduler/block_hash.py) are 64-bit FNV-1a over (has_parent byte, parent hash u64 LE
if any, token count u64 LE, each token id int32 LE): a block's hash depends on its tokens and its
parent's hash only, so the lineage is cached on the blocks and a prefix is never rehashed. The last `buffer_steps` batches are
kept for replay: a ROUTER socket on replay_endpoint answers [identity, "", start_seq (8 bytes BE)]
with one [identity, "", seq, payload] message per kept batch from start_seq on, then an end marker
[identity, "", -1, ""]. With several data-parallel replicas each replica's scheduler publishes on its own
endpoints (endpoint_for_rank: the TCP port plus the replica index) with attn_dp_rank set to its index.
The configuration and its per-rank endpoints are app/config/kv_events.py (the settings check them).
See docs/kv-events.md.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgpack

from app.config.kv_events import KVEventsConfig, rank_endpoints

log = logging.getLogger(__name__)

SEQ_BYTES = 8
END_OF_REPLAY = -1


# ---------------------------------------------------------------- recording


class KVEventRecorder:
    """Collects one step's events in order; the scheduler loop takes them once per step."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[list[Any]] = []

    def stored(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> None:
        self._events.append(["BlockStored", [block_hash], parent_hash, list(token_ids), self.block_size])

    def removed(self, block_hash: int) -> None:
        self._events.append(["BlockRemoved", [block_hash]])

    def take(self) -> list[list[Any]]:
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return len(self._events)


# ---------------------------------------------------------------- publishing


def _binds(endpoint: str) -> bool:
    """Wildcard hosts and local transports are bound; a concrete tcp address is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def decode_seq(raw: bytes) -> int:
    return int.from_bytes(raw, "big", signed=True)


class KVEventPublisher:
    """The PUB socket, the replay buffer and the optional replay ROUTER, driven by the scheduler loop of
    data-parallel rank dp_rank (its endpoints per rank_endpoints; attn_dp_rank in every batch)."""

    def __init__(self, config: KVEventsConfig, ctx: Any, dp_rank: int = 0) -> None:
        import zmq

        self._zmq = zmq
        self.dp_rank = dp_rank
        self.topic = config.topic.encode()
        self.seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        endpoint, replay_endpoint = rank_endpoints(config, dp_rank)
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, config.hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        if _binds(endpoint):
            self.pub.bind(endpoint)
        else:
            self.pub.connect(endpoint)
        self.replay = None
        if replay_endpoint is not None:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(replay_endpoint)
        log.info("KV cache events: publishing on %s (topic %r, attn_dp_rank %d)%s", endpoint, config.topic, dp_rank,
                 f", replay on {replay_endpoint}" if self.replay is not None else "")

    def publish(self, events: list[list[Any]]) -> None:
        """Send one batch (one scheduler step's events) and keep it for replay."""
        payload = msgpack.packb([time.time(), events, self.dp_rank])
        seq = self.seq
        self.seq += 1
        self._buffer.append((seq, payload))
        self.pub.send_multipart([self.topic, encode_seq(seq), payload], copy=False)

    def serve_replay(self) -> None:
        """Answer every waiting replay request (never blocks)."""
        if self.replay is None:
            return
        zmq = self._zmq
        while self.replay.poll(0):
            frames = self.replay.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != SEQ_BYTES:
                log.warning("KV events replay: dropping a malformed request of %d frames", len(frames))
                continue
            identity, start = frames[0], decode_seq(frames[2])
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self.replay.send_multipart([identity, b"", encode_seq(seq), payload])
            self.replay.send_multipart([identity, b"", encode_seq(END_OF_REPLAY), b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
