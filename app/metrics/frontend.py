"""Per-request metrics, recorded in the tokenizer process (off the scheduler's loop).

The tokenizer sees every request from admission to its terminal delta, including the ones that a
stop string ends there. Times are the scheduler's send time of each TokenDeltas message (so the
tokenizer's own lag does not count) against the arrival time the HTTP front stamped.

Counted: num_requests (every request admitted by the tokenizer that ended, whatever the reason),
request_success by finished_reason (stop, length), prompt_tokens (at finish), generation_tokens
(as tokens arrive, one increment per message), time_to_first_token (first token of a request),
inter_token_latency (each later token: gap since the previous delta / tokens in the delta),
e2e_request_latency and request_time_per_output_token (at a stop or length finish).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from app.metrics.catalog import build
from app.protocol import FINISH_LENGTH, FINISH_STOP, TokenDelta

SUCCESS_REASONS = (FINISH_STOP, FINISH_LENGTH)
_NAMES = ("num_requests", "request_success", "prompt_tokens", "generation_tokens",
          "time_to_first_token_seconds", "inter_token_latency_seconds",
          "request_time_per_output_token_seconds", "e2e_request_latency_seconds")


@dataclass(slots=True)
class _Timing:
    arrival: float
    prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0


class FrontendMetrics:
    def __init__(self, model_name: str, registry: Any = None) -> None:
        m = build(_NAMES, registry)
        self._model = model_name
        self._requests = m["num_requests"].labels(model_name=model_name)
        self._success = m["request_success"]
        self._prompt = m["prompt_tokens"].labels(model_name=model_name)
        self._generated = m["generation_tokens"].labels(model_name=model_name)
        self._ttft = m["time_to_first_token_seconds"].labels(model_name=model_name)
        self._itl = m["inter_token_latency_seconds"].labels(model_name=model_name)
        self._tpot = m["request_time_per_output_token_seconds"].labels(model_name=model_name)
        self._e2e = m["e2e_request_latency_seconds"].labels(model_name=model_name)
        for reason in SUCCESS_REASONS:  # present at 0 from the start
            self._success.labels(model_name=model_name, finished_reason=reason)
        self._live: dict[str, _Timing] = {}

    def admitted(self, rid: str, arrival_time: float, prompt_tokens: int) -> None:
        self._live[rid] = _Timing(arrival_time or time.time(), prompt_tokens)

    def tokens(self, deltas: Iterable[TokenDelta], sent_at: float) -> None:
        """One TokenDeltas message: latencies per request, one counter increment in all. Requests that
        decode in lockstep share their inter-token gap, so the gaps are recorded grouped."""
        generated = 0
        gaps: dict[float, int] = {}
        for delta in deltas:
            timing = self._live.get(delta.rid)
            n = len(delta.token_ids)
            if timing is None or n == 0:
                continue
            generated += n
            if timing.first_token is None:
                timing.first_token = sent_at
                self._ttft.observe(max(sent_at - timing.arrival, 0.0))
                n -= 1  # the rest of the delta (speculative tokens) follows the first one
            elif timing.last_token is not None:
                gap = max(sent_at - timing.last_token, 0.0) / n
                gaps[gap] = gaps.get(gap, 0) + n
            timing.last_token = sent_at
            timing.tokens += len(delta.token_ids)
        for gap, count in gaps.items():
            self._itl.observe_many(gap, count)
        if generated:
            self._generated.inc(generated)

    def finished(self, rid: str, reason: str | None, now: float) -> None:
        """The request's terminal delta went out (reason None: it failed without one)."""
        timing = self._live.pop(rid, None)
        if timing is None:
            return
        self._requests.inc()
        self._prompt.inc(timing.prompt_tokens)
        if reason not in SUCCESS_REASONS:
            return
        self._success.labels(model_name=self._model, finished_reason=reason).inc()
        self._e2e.observe(max(now - timing.arrival, 0.0))
        if timing.tokens > 1 and timing.first_token is not None:
            self._tpot.observe(max(now - timing.first_token, 0.0) / (timing.tokens - 1))
