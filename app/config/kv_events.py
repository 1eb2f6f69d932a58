"""--kv-events-config: its keys, and the endpoints each data-parallel rank publishes on.

Here rather than with the publisher (app/metrics/kv_events.py) because the settings' rules check a value
before any process starts, and app.config imports no process package.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


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
