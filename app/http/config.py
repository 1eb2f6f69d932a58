"""The slice of the appliance settings the HTTP process uses, read once from app.config.Settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pydantic import SecretBytes, SecretStr

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

    @classmethod
    def from_settings(cls, settings: Any) -> HttpConfig:
        """Read from app.config.Settings (or any object with the same fields, e.g. in tests)."""
        if isinstance(settings, HttpConfig):
            return settings
        log_level = str(settings.log_level).lower()
        return cls(
            host=settings.host,
            port=int(settings.port),
            model_path=settings.model,
            tokenizer_path=settings.tokenizer or settings.model,
            served_model_name=settings.served_model_name or settings.model,
            api_key=_api_key(settings),
            enable_cache_report=bool(settings.enable_cache_report),
            weight_version=str(settings.weight_version),
            stream_output=bool(settings.stream_output),
            log_level=log_level,
            log_level_http=str(settings.log_level_http or log_level).lower(),
            enable_log_requests=bool(settings.enable_log_requests),
            log_requests_level=int(settings.log_requests_level),
            drain_timeout=float(settings.drain_timeout),
            settings_view=masked_settings(settings),
        )

    def model_names(self) -> tuple[str, ...]:
        """Names a request's `model` may use: the served name or the model path."""
        return (self.served_model_name, self.model_path)


def _api_key(settings: Any) -> str | None:
    if hasattr(settings, "api_key_value"):  # app.config.Settings: the clear value behind a SecretStr
        return settings.api_key_value
    key = settings.api_key
    if isinstance(key, SecretStr):
        return key.get_secret_value()
    return key


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


def masked_settings(settings: Any) -> dict[str, Any]:
    """Every field of the settings object, with secrets replaced by a mask."""
    if hasattr(settings, "model_dump"):
        raw = settings.model_dump()
    elif dataclasses.is_dataclass(settings):
        raw = dataclasses.asdict(settings)
    else:
        raw = dict(vars(settings))
    return {name: _mask(name, value) for name, value in raw.items()}
