"""The tokenizer process's state machine, free of sockets: a message in, the messages to send out.

Inputs (its one inbox): EngineReady from the supervisor; GenerateRequest, AbortRequest and
ControlRequest from http; TokenDeltas and ControlReply from the schedulers. Outputs are
(destination, message, replica) triples, destinations "scheduler" (replica: which data-parallel replica's
scheduler) and "http".

With several data-parallel replicas (app/tokenizer/router.py) a new request goes to the replica the
router picks and its follow-ups (abort, stop-string finish) to the same one; abort-all goes to every
replica; a control operation goes to every replica and their replies reach http as one
(app/tokenizer/control_fanout.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.grammar import check_request
from app.protocol import (
    FINISH_ABORT,
    AbortRequest,
    ControlReply,
    ControlRequest,
    EngineInfo,
    EngineReady,
    FinishRequest,
    GenerateRequest,
    SamplingParams,
    TextDelta,
    TextDeltas,
    TokenDelta,
    TokenDeltas,
    TokenizedRequest,
)
from app.sampling_checks import check_for_backend
from app.tokenizer import tokenize_ops
from app.tokenizer.answer import answer_parser, tool_parser_keeps_special_tokens
from app.tokenizer.control_fanout import ControlFanOut
from app.tokenizer.grammar import GrammarService
from app.tokenizer.output import RequestOutput
from app.tokenizer.prompt import PromptError, build_prompt, validate_prompt
from app.tokenizer.router import Router

if TYPE_CHECKING:
    from app.metrics.frontend import FrontendMetrics

logger = logging.getLogger(__name__)

SCHEDULER = "scheduler"
HTTP = "http"


@dataclass(frozen=True)
class Outgoing:
    dest: str  # SCHEDULER or HTTP
    msg: Any
    replica: int = 0  # SCHEDULER: the data-parallel replica whose scheduler gets msg


class TokenizerCore:
    def __init__(
        self,
        tokenizer: Any | None,
        *,
        chat_template: str | None = None,
        stream_interval: int = 1,
        metrics: FrontendMetrics | None = None,
        router: Router | None = None,
        reasoning_parser: str | None = None,
        tool_call_parser: str | None = None,
        grammar_cache_size: int = 64,
        grammar_compile_timeout: float = 30.0,
    ) -> None:
        """tokenizer None means --skip-tokenizer-init: token-id prompts only, no text out.
        metrics: per-request metrics; without it they start with the engine when EngineReady says
        metrics are on (the supervisor puts enable_metrics and served_model_name in its info).
        router: spreads requests over the data-parallel replicas (default: one replica).
        reasoning_parser, tool_call_parser: --reasoning-parser and --tool-call-parser (app/tokenizer/answer.py).
        grammar_*: --grammar-cache-size and --grammar-compile-timeout (the defaults are Settings')."""
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._stream_interval = stream_interval
        self._metrics = metrics
        self._sent_at = 0.0
        self._engine: EngineInfo | None = None
        self._requests: dict[str, RequestOutput] = {}
        self._router = router or Router()
        self._reasoning_parser = reasoning_parser
        self._tool_call_parser = tool_call_parser
        self._controls = ControlFanOut(self._router.num_replicas)
        self._grammars = GrammarService(self._make_compiler, cache_size=grammar_cache_size,
                                        timeout_s=grammar_compile_timeout)
        self._handlers = {
            EngineReady: self._on_engine_ready,
            GenerateRequest: self._on_generate,
            TokenDeltas: self._on_token_deltas,
            AbortRequest: self._on_abort,
            ControlRequest: self._on_control,
            ControlReply: self._on_control_reply,
        }

    @property
    def num_live_requests(self) -> int:
        return len(self._requests)

    @property
    def engine_info(self) -> EngineInfo | None:
        return self._engine

    @property
    def router(self) -> Router:
        return self._router

    @property
    def grammars(self) -> GrammarService:
        return self._grammars

    def handle(self, msg: Any) -> list[Outgoing]:
        handler = self._handlers.get(type(msg))
        if handler is None:
            logger.warning("tokenizer: dropping unexpected message %s", type(msg).__name__)
            return []
        return handler(msg)

    # ------------------------------------------------------------ lifecycle

    def _on_engine_ready(self, msg: EngineReady) -> list[Outgoing]:
        info = msg.engine
        if info is None or info.max_model_len < 1 or info.vocab_size < 1:
            logger.error("tokenizer: EngineReady lacks the engine's figures (%s); still not serving", info)
            return []
        self._engine = info
        if self._metrics is None and info.enable_metrics:
            from app.metrics.frontend import FrontendMetrics

            self._metrics = FrontendMetrics(info.served_model_name)
        logger.info("tokenizer: engine ready (max_model_len=%d, vocab_size=%d, sampling backend %s)",
                    info.max_model_len, info.vocab_size, info.sampling_backend or "torch")
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
            refusal = admission_error(req.sampling, self._engine)
            if refusal is not None:
                return [_error(req.rid, refusal, 400)]
            prompt = self._prompt_of(req)
            state = self._output_of(req, prompt)
        except PromptError as exc:
            return [_error(req.rid, str(exc), 400)]
        except Exception as exc:  # a tokenizer failure must still answer the client
            logger.exception("tokenizer: failed to prepare request %s", req.rid)
            return [_error(req.rid, f"failed to tokenize the request: {exc}", 500)]
        spec = req.sampling.grammar
        if spec is not None:
            return self._constrained(req, prompt, state)
        return self._admit(req, prompt, state)

    def _admit(self, req: GenerateRequest, prompt: list[int], state: RequestOutput) -> list[Outgoing]:
        self._requests[req.rid] = state
        replica = self._router.route(req.rid, prompt)
        if self._metrics is not None:
            self._metrics.admitted(req.rid, req.arrival_time, len(prompt))
        return [Outgoing(SCHEDULER, TokenizedRequest(req.rid, prompt, req.sampling, req.arrival_time), replica)]

    # ------------------------------------------------------------ structured output

    def _constrained(self, req: GenerateRequest, prompt: list[int], state: RequestOutput) -> list[Outgoing]:
        """A request with a grammar goes on once its grammar is compiled (at once when cached)."""
        spec = req.sampling.grammar
        assert spec is not None
        if self._tokenizer is None:
            return [_error(req.rid, "structured output needs the tokenizer, which --skip-tokenizer-init "
                           "disables", 400)]
        problem = check_request(spec, req.sampling)
        if problem is not None:
            return [_error(req.rid, problem, 400)]
        spec.compiled = ""  # only ever what this process compiled
        outcome = self._grammars.lookup(spec)
        if outcome is None:
            self._requests[req.rid] = state
            self._grammars.hold(req.rid, spec, (req, prompt))
            return []
        return self._compiled(req, prompt, state, outcome)

    def _compiled(self, req: GenerateRequest, prompt: list[int], state: RequestOutput, outcome: Any) -> list[Outgoing]:
        if outcome.error:
            return [_error(req.rid, outcome.error, 400)]
        assert req.sampling.grammar is not None
        req.sampling.grammar.compiled = outcome.compiled
        return self._admit(req, prompt, state)

    def poll_grammars(self) -> list[Outgoing]:
        """Requests whose grammar compile ended (or timed out) since the last poll: sent on, or failed."""
        out: list[Outgoing] = []
        for held, outcome in self._grammars.poll():
            req, prompt = held.payload
            state = self._requests.pop(req.rid, None)
            if state is not None:
                out.extend(self._compiled(req, prompt, state, outcome))
        return out

    def _make_compiler(self) -> Any:
        """On the grammar thread, with the first grammar: XGrammar over the engine's vocabulary."""
        from app.grammar.compiler import Compiler, tokenizer_info

        assert self._engine is not None
        return Compiler(tokenizer_info(self._tokenizer, self._engine.vocab_size, list(self._engine.eos_token_ids)))

    def _release_held(self, rid: str) -> list[Outgoing]:
        """An abort of a request still waiting for its compile: it ends here."""
        if self._grammars.release(rid) is None:
            return []
        self._requests.pop(rid, None)
        return [Outgoing(HTTP, TextDeltas([TextDelta(rid=rid, text="", token_ids=[], finish_reason=FINISH_ABORT)]))]

    def _prompt_of(self, req: GenerateRequest) -> list[int]:
        assert self._engine is not None
        prompt = build_prompt(
            req, self._tokenizer, chat_template=self._chat_template, vocab_size=self._engine.vocab_size
        )
        validate_prompt(prompt, req.sampling.max_new_tokens, max_model_len=self._engine.max_model_len)
        return prompt

    def _output_of(self, req: GenerateRequest, prompt: list[int]) -> RequestOutput:
        if req.sampling.stop and self._tokenizer is None:
            raise PromptError("stop strings need the tokenizer, which --skip-tokenizer-init disables")
        if any(not isinstance(s, str) or not s for s in req.sampling.stop):
            raise PromptError("stop strings must be non-empty strings")
        sampling = req.sampling
        answer = None
        if self._tokenizer is not None:
            answer = answer_parser(req, self._tokenizer, prompt, reasoning_parser=self._reasoning_parser,
                                   tool_call_parser=self._tool_call_parser)
            if tool_parser_keeps_special_tokens(self._tool_call_parser, req):
                sampling = dataclasses.replace(sampling, skip_special_tokens=False)
        return RequestOutput(
            req.rid, sampling, tokenizer=self._tokenizer, stream=req.stream,
            stream_interval=self._stream_interval, prompt_ids=prompt, return_prompt_ids=req.return_prompt_ids,
            answer=answer,
        )

    # ------------------------------------------------------------ aborts and control

    def _on_abort(self, msg: AbortRequest) -> list[Outgoing]:
        if msg.abort_all:
            held = [out for rid in list(self._grammars.held_rids()) for out in self._release_held(rid)]
            return held + self._to_every_replica(msg)
        return self._release_held(msg.rid or "") or self._to_holder(msg.rid or "", msg)

    def _on_control(self, msg: ControlRequest) -> list[Outgoing]:
        if isinstance(msg.op, tokenize_ops.OPS):  # answered here: the tokenizer is in this process
            if self._engine is None:
                return [Outgoing(HTTP, ControlReply(msg.req_id, False, "the engine is not ready yet"))]
            return [Outgoing(HTTP, tokenize_ops.handle(msg, self._tokenizer, chat_template=self._chat_template,
                                                       vocab_size=self._engine.vocab_size))]
        refused = self._controls.refusal(msg)
        if refused is not None:
            return [Outgoing(HTTP, refused)]
        return [Outgoing(SCHEDULER, copy, replica) for replica, copy in self._controls.split(msg)]

    def _on_control_reply(self, msg: ControlReply) -> list[Outgoing]:
        combined = self._controls.collect(msg)
        return [Outgoing(HTTP, combined)] if combined is not None else []

    def _to_every_replica(self, msg: Any) -> list[Outgoing]:
        return [Outgoing(SCHEDULER, msg, replica) for replica in range(self._router.num_replicas)]

    def _to_holder(self, rid: str, msg: Any) -> list[Outgoing]:
        """msg to the replica holding rid; nothing if no replica does (it is over already)."""
        replica = self._router.replica_of(rid)
        if replica is None:
            logger.debug("tokenizer: %s for %r dropped: the request is not live", type(msg).__name__, rid)
            return []
        return [Outgoing(SCHEDULER, msg, replica)]

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
            if delta.finish_reason is None:
                out.extend(self._to_holder(delta.rid, AbortRequest(rid=delta.rid, reason="detokenization failed")))
            self._drop(delta.rid)
            self._finished(delta.rid, None)
            return [_error_delta(delta.rid, f"failed to detokenize the output: {exc}", 500)]
        if result.stop_matched:
            out.extend(self._to_holder(delta.rid, FinishRequest(delta.rid)))
        if result.finished:
            self._drop(delta.rid)
            final = result.text_delta
            self._finished(delta.rid, final.finish_reason if final is not None and final.error is None else None)
        return [result.text_delta] if result.text_delta is not None else []

    def _drop(self, rid: str) -> None:
        """The request is over here: forget it and its replica (messages for it must be routed before)."""
        del self._requests[rid]
        self._router.release(rid)

    def _finished(self, rid: str, reason: str | None) -> None:
        if self._metrics is not None:
            self._metrics.finished(rid, reason, self._sent_at)


def admission_error(sampling: SamplingParams, engine: EngineInfo) -> str | None:
    """Why the engine cannot serve these parameters (the message names the field), or None. Checked
    here so that the worker never meets a sequence it must refuse: one request's bad parameters
    must not reach a step shared with others."""
    if sampling.top_logprobs > engine.max_top_logprobs:
        return (f"top_logprobs {sampling.top_logprobs} exceeds the engine's maximum of "
                f"{engine.max_top_logprobs} alternatives per position")
    return check_for_backend(engine.sampling_backend, sampling, engine.vocab_size)


def _error_delta(rid: str, message: str, code: int) -> TextDelta:
    return TextDelta(rid=rid, text="", token_ids=[], finish_reason=FINISH_ABORT, error=message, error_code=code)


def _error(rid: str, message: str, code: int) -> Outgoing:
    return Outgoing(HTTP, TextDeltas([_error_delta(rid, message, code)]))
