"""The tokenizer process's state machine, free of sockets: a message in, the messages to send out.

Inputs (its one inbox): EngineReady from the supervisor; GenerateRequest, AbortRequest and
ControlRequest from http; TokenDeltas and ControlReply from the scheduler. Outputs are
(destination, message) pairs, destinations "scheduler" and "http".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.protocol import (
    FINISH_ABORT,
    AbortRequest,
    ControlReply,
    ControlRequest,
    EngineReady,
    FinishRequest,
    GenerateRequest,
    TextDelta,
    TextDeltas,
    TokenDelta,
    TokenDeltas,
    TokenizedRequest,
)
from app.tokenizer.output import RequestOutput
from app.tokenizer.prompt import PromptError, build_prompt, validate_prompt

if TYPE_CHECKING:
    from app.metrics.frontend import FrontendMetrics

logger = logging.getLogger(__name__)

SCHEDULER = "scheduler"
HTTP = "http"


@dataclass(frozen=True)
class Outgoing:
    dest: str  # SCHEDULER or HTTP
    msg: Any


class TokenizerCore:
    def __init__(
        self,
        tokenizer: Any | None,
        *,
        chat_template: str | None = None,
        stream_interval: int = 1,
        metrics: FrontendMetrics | None = None,
    ) -> None:
        """tokenizer None means --skip-tokenizer-init: token-id prompts only, no text out.
        metrics: per-request metrics; without it they start with the engine when EngineReady says
        metrics are on (the supervisor puts enable_metrics and served_model_name in its info)."""
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._stream_interval = stream_interval
        self._metrics = metrics
        self._sent_at = 0.0
        self._engine: dict[str, Any] | None = None
        self._requests: dict[str, RequestOutput] = {}
        self._handlers = {
            EngineReady: self._on_engine_ready,
            GenerateRequest: self._on_generate,
            TokenDeltas: self._on_token_deltas,
            AbortRequest: lambda m: [Outgoing(SCHEDULER, m)],
            ControlRequest: lambda m: [Outgoing(SCHEDULER, m)],
            ControlReply: lambda m: [Outgoing(HTTP, m)],
        }

    @property
    def num_live_requests(self) -> int:
        return len(self._requests)

    @property
    def engine_info(self) -> dict[str, Any] | None:
        return self._engine

    def handle(self, msg: Any) -> list[Outgoing]:
        handler = self._handlers.get(type(msg))
        if handler is None:
            logger.warning("tokenizer: dropping unexpected message %s", type(msg).__name__)
            return []
        return handler(msg)

    # ------------------------------------------------------------ lifecycle

    def _on_engine_ready(self, msg: EngineReady) -> list[Outgoing]:
        info = dict(msg.info)
        missing = [k for k in ("max_model_len", "vocab_size") if not isinstance(info.get(k), int)]
        if missing:
            logger.error("tokenizer: EngineReady lacks %s; still not serving", ", ".join(missing))
            return []
        self._engine = info
        if self._metrics is None and info.get("enable_metrics"):
            from app.metrics.frontend import FrontendMetrics

            self._metrics = FrontendMetrics(str(info.get("served_model_name", "")))
        logger.info("tokenizer: engine ready (max_model_len=%d, vocab_size=%d)",
                    info["max_model_len"], info["vocab_size"])
        # http learns readiness from us, behind this message on the same socket: it can never
        # admit a request we would refuse as not ready.
        return [Outgoing(HTTP, msg)]

    # ------------------------------------------------------------ requests in

    def _on_generate(self, req: GenerateRequest) -> list[Outgoing]:
        if self._engine is None:
            return [_error(req.rid, "the engine is not ready yet", 503)]
        if req.rid in self._requests:
            return [_error(req.rid, f"request id {req.rid!r} is already in use", 400)]
        try:
            prompt = self._prompt_of(req)
            state = self._output_of(req, prompt)
        except PromptError as exc:
            return [_error(req.rid, str(exc), 400)]
        except Exception as exc:  # a tokenizer failure must still answer the client
            logger.exception("tokenizer: failed to prepare request %s", req.rid)
            return [_error(req.rid, f"failed to tokenize the request: {exc}", 500)]
        self._requests[req.rid] = state
        if self._metrics is not None:
            self._metrics.admitted(req.rid, req.arrival_time, len(prompt))
        return [Outgoing(SCHEDULER, TokenizedRequest(req.rid, prompt, req.sampling, req.arrival_time))]

    def _prompt_of(self, req: GenerateRequest) -> list[int]:
        assert self._engine is not None
        prompt = build_prompt(
            req, self._tokenizer, chat_template=self._chat_template, vocab_size=self._engine["vocab_size"]
        )
        validate_prompt(prompt, req.sampling.max_new_tokens, max_model_len=self._engine["max_model_len"])
        return prompt

    def _output_of(self, req: GenerateRequest, prompt: list[int]) -> RequestOutput:
        if req.sampling.stop and self._tokenizer is None:
            raise PromptError("stop strings need the tokenizer, which --skip-tokenizer-init disables")
        if any(not isinstance(s, str) or not s for s in req.sampling.stop):
            raise PromptError("stop strings must be non-empty strings")
        return RequestOutput(
            req.rid, req.sampling, tokenizer=self._tokenizer, stream=req.stream,
            stream_interval=self._stream_interval, prompt_ids=prompt, return_prompt_ids=req.return_prompt_ids,
        )

    # ------------------------------------------------------------ outputs back

    def _on_token_deltas(self, msg: TokenDeltas) -> list[Outgoing]:
        text_deltas: list[TextDelta] = []
        out: list[Outgoing] = []
        self._sent_at = msg.time or time.time()  # when the scheduler produced these tokens
        if self._metrics is not None:
            self._metrics.tokens(msg.deltas, self._sent_at)
        for delta in msg.deltas:
            state = self._requests.get(delta.rid)
            if state is None:  # finished here on a stop string, or never admitted
                continue
            text_deltas.extend(self._advance(state, delta, out))
        if text_deltas:
            out.insert(0, Outgoing(HTTP, TextDeltas(text_deltas)))
        return out

    def _advance(self, state: RequestOutput, delta: TokenDelta, out: list[Outgoing]) -> list[TextDelta]:
        try:
            result = state.on_delta(delta)
        except Exception as exc:  # a bad delta fails its request, not the process
            logger.exception("tokenizer: failed to detokenize request %s", delta.rid)
            del self._requests[delta.rid]
            self._finished(delta.rid, None)
            if delta.finish_reason is None:
                out.append(Outgoing(SCHEDULER, AbortRequest(rid=delta.rid, reason="detokenization failed")))
            return [_error_delta(delta.rid, f"failed to detokenize the output: {exc}", 500)]
        if result.stop_matched:
            out.append(Outgoing(SCHEDULER, FinishRequest(delta.rid)))
        if result.finished:
            del self._requests[delta.rid]
            final = result.text_delta
            self._finished(delta.rid, final.finish_reason if final is not None and final.error is None else None)
        return [result.text_delta] if result.text_delta is not None else []

    def _finished(self, rid: str, reason: str | None) -> None:
        if self._metrics is not None:
            self._metrics.finished(rid, reason, self._sent_at)


def _error_delta(rid: str, message: str, code: int) -> TextDelta:
    return TextDelta(rid=rid, text="", token_ids=[], finish_reason=FINISH_ABORT, error=message, error_code=code)


def _error(rid: str, message: str, code: int) -> Outgoing:
    return Outgoing(HTTP, TextDeltas([_error_delta(rid, message, code)]))
