"""--enable-log-request-stats: the scheduler's per-request finish line.

    Req: <rid> Finish! RequestStats(status='finished', reason='stop', prompt_tokens=..., ...)

Every field comes from host-side timestamps and counters the scheduler keeps anyway (time.time() at
admission, first scheduling, prompt done, first token, finish), so the line costs no device sync.
Fields that a request never reached (an abort while queued has no first token) are None. Without
the flag the scheduler logs a short `Req: <rid> Finish! reason=..., output_tokens=...` line at
debug level instead (TokenSpeed logs Accept_num_tokens_avg there, which without speculative
decoding carries no information).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from app.protocol import FINISH_ABORT

log = logging.getLogger("tokenspeed.scheduler")


@dataclass(frozen=True, slots=True)
class RequestStats:
    status: str  # finished | aborted
    reason: str  # stop | length | abort
    prompt_tokens: int
    cache_tokens: int  # prompt tokens served from the prefix cache
    output_tokens: int
    cache_hit_rate: float  # cache_tokens / prompt_tokens
    queue_ms: float | None  # received -> first scheduled
    prefill_ms: float | None  # first scheduled -> prompt fully computed
    ttft_ms: float | None  # received -> first output token
    total_ms: float  # received -> finished or aborted
    preempt_ms: float  # decode time lost to steps that prefilled other requests
    preempt_count: int  # stretches of such steps
    decode_tps: float  # (output_tokens - 1) / (finish - first token)
    # Speculative decoding (None when it is off): tokens a verify step gave (1 + accepted drafts, averaged
    # over the request's verify steps; 1.0 if it never drafted) and the share of its drafts accepted.
    acc_len: float | None
    acc_rate: float | None
    recv_ts: float  # epoch seconds
    commit_ts: float | None
    finish_ts: float


def _ms(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return round(max(end - start, 0.0) * 1000.0, 1)


def _ts(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def request_stats(req: Any, reason: str, speculative: bool = False) -> RequestStats:
    """The stats of a finished app.scheduler.request.Request (its finish_time set); speculative: whether
    the engine speculates (acc_len / acc_rate are None otherwise)."""
    finish = req.finish_time
    n_prompt, n_out = len(req.prompt_ids), len(req.output_ids)
    first = req.first_token_time
    decode_window = finish - first if first is not None else 0.0
    tps = (n_out - 1) / decode_window if n_out > 1 and decode_window > 0 else 0.0
    return RequestStats(
        status="aborted" if reason == FINISH_ABORT else "finished",
        reason=reason,
        prompt_tokens=n_prompt,
        cache_tokens=req.cached_tokens,
        output_tokens=n_out,
        cache_hit_rate=round(req.cached_tokens / n_prompt, 4) if n_prompt else 0.0,
        queue_ms=_ms(req.arrival_time, req.first_scheduled_time),
        prefill_ms=_ms(req.first_scheduled_time, req.prefill_done_time),
        ttft_ms=_ms(req.arrival_time, first),
        total_ms=_ms(req.arrival_time, finish) or 0.0,
        preempt_ms=round(req.delayed_seconds * 1000.0, 1),
        preempt_count=req.delay_count,
        decode_tps=round(tps, 1),
        acc_len=_acc_len(req) if speculative else None,
        acc_rate=(round(req.spec_accepted_tokens / req.spec_draft_tokens, 4) if req.spec_draft_tokens else 0.0)
        if speculative else None,
        recv_ts=round(req.arrival_time, 3),
        commit_ts=_ts(req.first_scheduled_time),
        finish_ts=round(finish, 3),
    )


def _acc_len(req: Any) -> float:
    steps = req.spec_verify_steps
    return round(1 + req.spec_accepted_tokens / steps, 3) if steps else 1.0


class FinishLogger:
    """The scheduler's on_finish hook: the stats line at info with the flag, a short one at debug."""

    def __init__(self, log_stats: bool, speculative: bool = False) -> None:
        self.log_stats = log_stats
        self.speculative = speculative

    def __call__(self, req: Any, reason: str) -> None:
        if self.log_stats:
            log.info("Req: %s Finish! %r", req.rid, request_stats(req, reason, self.speculative))
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("Req: %s Finish! reason=%s, output_tokens=%d", req.rid, reason, len(req.output_ids))
