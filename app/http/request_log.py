"""--enable-log-requests: one line per request received and one per request finished.

Level 0: rid, route, prompt length and sampling parameters; level 1: plus the first 2048 characters
of the prompt and the output; level 2: everything. Headers are never logged, so neither is the key.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import Any

from app.protocol import SamplingParams, TextDelta

log = logging.getLogger("app.http.requests")

PARTIAL_CHARS = 2048


class RequestLog:
    def __init__(self, enabled: bool, level: int) -> None:
        self.enabled = enabled
        self.level = level

    def _clip(self, text: str) -> str:
        return text if self.level >= 2 else text[:PARTIAL_CHARS]

    def received(self, rid: str, route: str, prompts: Sequence[Any], sampling: SamplingParams | None,
                 extra: dict[str, Any] | None = None) -> None:
        if not self.enabled:
            return
        sizes = [len(p) for p in prompts]
        params = dataclasses.asdict(sampling) if sampling is not None else {}
        params.update(extra or {})
        line = f"request rid={rid} route={route} prompt_len={sizes} params={params}"
        if self.level >= 1:
            shown = [p if isinstance(p, str) else json.dumps(p, ensure_ascii=False) for p in prompts]
            line += f" prompt={[self._clip(p) for p in shown]!r}"
        log.info(line)

    def finished(self, rid: str, outputs: Sequence[TextDelta | None], status: int = 200) -> None:
        if not self.enabled:
            return
        done = [o for o in outputs if o is not None]
        reasons = [o.finish_reason for o in done]
        tokens = [o.completion_tokens for o in done]
        line = f"finish rid={rid} status={status} finish_reason={reasons} completion_tokens={tokens}"
        if self.level >= 1:
            line += f" output={[self._clip(o.text) for o in done]!r}"
        log.info(line)
