"""The slice of the appliance settings the HTTP process uses, read once from app.config.Settings."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from pydantic import SecretBytes, SecretStr

from app.config.settings import Settings

MASK = "**********"
_SECRET_NAMES = ("api_key", "secret", "password", "hf_token")


@dataclass(frozen=True)
class HttpConfig:
    host: str
    port: int
    model_path: str
    tokenizer_path: str
    served_model_name: str
    api_key: str | None
    enable_cache_report: bool
    weight_version: str
    stream_output: bool
    log_level: str
    log_level_http: str
    enable_log_requests: bool
    log_requests_level: int
    drain_timeout: float
    settings_view: dict[str, Any]  # every resolved setting, secrets masked (GET /get_server_info)
    enable_metrics: bool  # GET /metrics (Prometheus), open without the API key
    # Reliability (docs/operations.md).
    admin_api_key: str | None  # with it, the control routes need this key (it opens every route)
    max_num_seqs: int
    max_queued_requests: int
    heartbeat_timeout: float
    worker_heartbeat_timeout: float
    data_parallel_size: int  # replicas, each with its own --max-num-seqs and --max-queued-requests
    allow_remote_admin: bool  # --allow-remote-admin: control routes open on a public bind
    reasoning_parser: str | None  # --reasoning-parser: chat answers carry reasoning_content
    tool_call_parser: str | None  # --tool-call-parser: chat answers carry tool_calls

    @property
    def capacity(self) -> int:
        """Engine requests the appliance holds at once: running plus queued, on every replica; beyond it, 503."""
        return (self.max_num_seqs + self.max_queued_requests) * self.data_parallel_size

    @classmethod
    def from_settings(cls, settings: Settings) -> HttpConfig:
        log_level = str(settings.log_level).lower()
        return cls(
            host=settings.host,
            port=int(settings.port),
            model_path=settings.model,
            tokenizer_path=settings.tokenizer or settings.model,
            served_model_name=settings.served_model_name or settings.model,
            api_key=settings.api_key_value,
            enable_cache_report=settings.enable_cache_report,
            weight_version=str(settings.weight_version),
            stream_output=settings.stream_output,
            log_level=log_level,
            log_level_http=str(settings.log_level_http or log_level).lower(),
            enable_log_requests=settings.enable_log_requests,
            log_requests_level=settings.log_requests_level,
            drain_timeout=settings.drain_timeout,
            settings_view=masked_settings(settings),
            enable_metrics=settings.enable_metrics and "prometheus" in settings.metrics_reporters,
            admin_api_key=settings.admin_api_key_value,
            max_num_seqs=settings.max_num_seqs,
            max_queued_requests=settings.max_queued_requests,
            heartbeat_timeout=settings.heartbeat_timeout,
            worker_heartbeat_timeout=settings.worker_heartbeat_timeout,
            data_parallel_size=settings.data_parallel_size,
            allow_remote_admin=settings.allow_remote_admin,
            reasoning_parser=settings.reasoning_parser,
            tool_call_parser=settings.tool_call_parser,
        )

    @property
    def admin_closed(self) -> bool:
        """Whether the control routes answer 403 whatever the key: reachable from outside (a non-loopback
        bind) with no admin key, and not opened explicitly by --allow-remote-admin."""
        return not self.admin_api_key and not self.allow_remote_admin and not is_loopback(self.host)

    def model_names(self) -> tuple[str, ...]:
        """Names a request's `model` may use: the served name or the model path."""
        return (self.served_model_name, self.model_path)


def is_loopback(host: str) -> bool:
    """Whether a bind address is reachable from this host only (0.0.0.0 and :: are every interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to a public interface
        return False


def _is_secret_name(name: str) -> bool:
    return any(part in name.lower() for part in _SECRET_NAMES)


def _mask(name: str, value: Any) -> Any:
    if isinstance(value, SecretStr | SecretBytes):
        return MASK
    if isinstance(value, dict):
        return {k: _mask(str(k), v) for k, v in value.items()}
    if value is not None and _is_secret_name(name):
        return MASK
    return value


def masked_settings(settings: Settings) -> dict[str, Any]:
    """Every field of the settings, with secrets replaced by a mask."""
    return {name: _mask(name, value) for name, value in settings.model_dump().items()}
