"""KV cache events: prefix-cache blocks stored and removed, published on a ZMQ PUB socket.

Configured by --kv-events-config (KVEventsConfig). The scheduler's KVCacheManager reports each block
it registers in the prefix cache (BlockStored) and each one it evicts or flushes (BlockRemoved) to a
KVEventRecorder; once per scheduler step the recorded events go out as one batch:

    frames: [topic bytes, sequence number (8 bytes, big-endian, from 0), msgpack payload]
    payload: [timestamp, [event, ...], attn_dp_rank]
    event:   ["BlockStored", [block_hash], parent_hash | None, token_ids, block_size]
             ["BlockRemoved", [block_hash]]

Block hashes are 64-bit FNV-1a over (has_parent byte, parent hash u64 LE if any, token count u64 LE,
each token id int32 LE): a block's hash depends on its tokens and its parent's hash only, so the
lineage is cached on the blocks and a prefix is never rehashed. The last `buffer_steps` batches are
kept for replay: a ROUTER socket on replay_endpoint answers [identity, "", start_seq (8 bytes BE)]
with one [identity, "", seq, payload] message per kept batch from start_seq on, then an end marker
[identity, "", -1, ""]. With several data-parallel replicas each replica's scheduler publishes on its own
endpoints (endpoint_for_rank: the TCP port plus the replica index) with attn_dp_rank set to its index.
See docs/kv-events.md.
"""

from __future__ import annotations

import logging
import struct
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)

FNV_OFFSET = 14695981039346656037
FNV_PRIME = 1099511628211
_MASK64 = (1 << 64) - 1
SEQ_BYTES = 8
END_OF_REPLAY = -1


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """64-bit FNV-1a of one block given its parent's hash (None for the first block of a sequence)."""
    data = bytearray(b"\x01" if parent is not None else b"\x00")
    if parent is not None:
        data += parent.to_bytes(8, "little")
    data += len(token_ids).to_bytes(8, "little")
    data += struct.pack(f"<{len(token_ids)}i", *token_ids)
    h = FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & _MASK64
    return h


# ---------------------------------------------------------------- config


class KVEventsConfig(BaseModel):
    """--kv-events-config: every key optional; unknown keys and loose types are errors."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    enable_kv_cache_events: bool = False
    publisher: Literal["zmq", "null"] | None = None  # unset: zmq when enabled
    endpoint: str = Field("tcp://*:5557", min_length=1)
    topic: str = ""
    replay_endpoint: str | None = Field(None, min_length=1)
    buffer_steps: int = Field(10000, ge=1)  # batches kept for replay
    hwm: int = Field(100000, ge=0)  # PUB send high-water mark (0: unlimited)

    @property
    def active(self) -> bool:
        """Events are hashed and published only when enabled with the zmq publisher."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


def parse_kv_events_config(value: dict[str, Any] | None) -> KVEventsConfig | None:
    """The config, or None when events are off; raises ValueError naming the bad key."""
    if value is None:
        return None
    try:
        config = KVEventsConfig.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"invalid --kv-events-config: {problems}") from None
    return config if config.active else None


def kv_events_config_problem(value: Any, data_parallel_size: int = 1) -> str | None:
    """Why a --kv-events-config value is invalid, or None (for the settings' rules): its keys, and that
    every data-parallel rank gets valid endpoints of its own."""
    if value is not None and not isinstance(value, dict):
        return "must be a JSON object"
    try:
        config = parse_kv_events_config(value)
        if config is not None:
            for rank in range(data_parallel_size):
                rank_endpoints(config, rank)
    except ValueError as exc:
        return str(exc)
    return None


def endpoint_for_rank(endpoint: str, dp_rank: int) -> str:
    """The endpoint data-parallel rank dp_rank uses: rank 0 the configured one; rank d > 0 the TCP port
    plus d (TokenSpeed's offset), or for ipc:// and inproc:// the name with `_dp<d>` appended."""
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{dp_rank}"
    head, _, port = endpoint.rpartition(":")
    if not head or not port.isdigit():
        raise ValueError(f"invalid --kv-events-config: endpoint {endpoint!r} needs an explicit port, which each "
                         "data-parallel rank offsets by its index")
    if int(port) + dp_rank > 65535:
        raise ValueError(f"invalid --kv-events-config: endpoint {endpoint!r} plus data-parallel rank {dp_rank} "
                         "is past port 65535")
    return f"{head}:{int(port) + dp_rank}"


def rank_endpoints(config: KVEventsConfig, dp_rank: int) -> tuple[str, str | None]:
    """(publish endpoint, replay endpoint or None) of one data-parallel rank."""
    replay = config.replay_endpoint
    return endpoint_for_rank(config.endpoint, dp_rank), (endpoint_for_rank(replay, dp_rank) if replay else None)


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
