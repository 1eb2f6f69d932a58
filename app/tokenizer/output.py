"""One live request's output side: token deltas in, text deltas out.

Detokenizes, matches stop strings, and batches what it produces into TextDeltas: a streaming
request sends its first token at once and then every `stream_interval` tokens; a non-streaming
request sends one delta, at the end. Every request ends with exactly one terminal delta.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.protocol import FINISH_STOP, SamplingParams, TextDelta, TokenDelta, TokenLogprobs, ToolCall
from app.tokenizer.answer import AnswerParser
from app.tokenizer.detokenizer import IncrementalDetokenizer, token_texts
from app.tokenizer.stop import StopMatcher


@dataclass
class _Pending:
    """What was produced since the last TextDelta went out."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class DeltaResult:
    """on_delta's answer: the TextDelta to send (if any), and whether the request is over."""

    text_delta: TextDelta | None
    finished: bool
    stop_matched: bool  # a stop string ended it here: the scheduler must be told


class RequestOutput:
    def __init__(
        self,
        rid: str,
        sampling: SamplingParams,
        *,
        tokenizer: Any | None,
        stream: bool,
        stream_interval: int,
        prompt_ids: list[int],
        return_prompt_ids: bool = False,
        answer: AnswerParser | None = None,
    ) -> None:
        """answer: splits a chat answer into reasoning, content and tool calls (None: text as is)."""
        self.rid = rid
        self._sampling = sampling
        self._tokenizer = tokenizer
        self._stream = stream
        self._interval = max(1, stream_interval)
        self._prompt_ids = prompt_ids if return_prompt_ids else None
        self._prompt = prompt_ids  # the texts of its tokens go with prompt logprobs
        self._detok = None
        self._stop = None
        if tokenizer is not None:
            self._detok = IncrementalDetokenizer(
                tokenizer,
                skip_special_tokens=sampling.skip_special_tokens,
                spaces_between_special_tokens=sampling.spaces_between_special_tokens,
                prompt_ids=prompt_ids,
            )
            if sampling.stop:
                self._stop = StopMatcher(sampling.stop, no_stop_trim=sampling.no_stop_trim)
        self._answer = answer
        self._pending = _Pending()
        self._sent_any = False
        self._since_sent = 0
        self._prompt_logprobs: list[TokenLogprobs] = []  # held until the next TextDelta goes out

    def on_delta(self, delta: TokenDelta) -> DeltaResult:
        ids = list(delta.token_ids)
        self._prompt_logprobs += delta.prompt_logprobs
        text, used, matched = self._text_of(ids, delta)
        self._add_text(text, final=matched is not None or delta.finish_reason is not None)
        self._pending.token_ids.extend(ids[:used])
        self._pending.logprobs.extend(delta.logprobs[:used])
        self._since_sent += used
        if matched is not None:
            completion = delta.completion_tokens - (len(ids) - used)
            # If the scheduler's delta was terminal already, it has freed the request itself.
            return DeltaResult(self._stopped_delta(delta, matched, completion), True, delta.finish_reason is None)
        if delta.finish_reason is not None:
            return DeltaResult(self._final_delta(delta), True, False)
        if self._stream and used and (not self._sent_any or self._since_sent >= self._interval):
            return DeltaResult(self._take(delta), False, False)
        return DeltaResult(None, False, False)

    # ------------------------------------------------------------ text

    def _add_text(self, text: str, *, final: bool) -> None:
        if self._answer is None:
            self._pending.text.append(text)
            return
        parsed = self._answer.feed(text, final=final)
        self._pending.text.append(parsed.content)
        self._pending.reasoning.append(parsed.reasoning)
        self._pending.tool_calls.extend(parsed.calls)

    def _text_of(self, ids: list[int], delta: TokenDelta) -> tuple[str, int, str | None]:
        """(new final text, how many of ids it used, the stop string matched or None)."""
        if self._detok is None:
            return "", len(ids), None
        text_ids = ids[:-1] if self._drops_stop_token(ids, delta) else ids
        parts: list[str] = []
        if self._stop is None:
            parts.append(self._detok.add(text_ids))
        else:
            for i, tid in enumerate(text_ids):
                out, matched = self._stop.feed(self._detok.add([tid]))
                parts.append(out)
                if matched is not None:
                    return "".join(parts), i + 1, matched
        if delta.finish_reason is not None:
            tail, matched = self._finish_text(match=delta.error is None)
            parts.append(tail)
            if matched is not None:
                return "".join(parts), len(ids), matched
        return "".join(parts), len(ids), None

    def _drops_stop_token(self, ids: list[int], delta: TokenDelta) -> bool:
        """A request stopped by a stop token (EOS included) gets no text for that token."""
        matched = delta.matched_stop
        return (
            delta.finish_reason == FINISH_STOP
            and isinstance(matched, int) and not isinstance(matched, bool)
            and bool(ids) and ids[-1] == matched
            and not self._sampling.no_stop_trim
        )

    def _finish_text(self, *, match: bool) -> tuple[str, str | None]:
        """Release held-back text at the end; it may still complete a stop string (unless the
        request failed: then its error is the outcome to report)."""
        assert self._detok is not None
        tail = self._detok.flush()
        if self._stop is None:
            return tail, None
        if not match:
            return self._stop.flush() + tail, None
        out, matched = self._stop.feed(tail)
        if matched is not None:
            return out, matched
        return out + self._stop.flush(), None

    # ------------------------------------------------------------ deltas

    def _take(self, delta: TokenDelta) -> TextDelta:
        pending, self._pending = self._pending, _Pending()
        out = TextDelta(
            rid=self.rid,
            text="".join(pending.text),
            token_ids=pending.token_ids,
            prompt_tokens=delta.prompt_tokens,
            completion_tokens=delta.completion_tokens,
            cached_tokens=delta.cached_tokens,
            logprobs=pending.logprobs,
            reasoning_text="".join(pending.reasoning),
            tool_calls=pending.tool_calls,
        )
        if pending.logprobs and self._tokenizer is not None:
            out.token_texts = token_texts(self._tokenizer, [lp.token_id for lp in pending.logprobs])
            out.top_token_texts = [token_texts(self._tokenizer, lp.top_ids) for lp in pending.logprobs]
        if not self._sent_any and self._prompt_ids is not None:
            out.prompt_ids = list(self._prompt_ids)
            if self._tokenizer is not None:
                out.prompt_text = self._tokenizer.decode(self._prompt_ids, skip_special_tokens=False)
        if self._prompt_logprobs:
            self._add_prompt_logprobs(out)
        self._sent_any = True
        self._since_sent = 0
        return out

    def _add_prompt_logprobs(self, out: TextDelta) -> None:
        out.prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, []
        if self._tokenizer is not None:
            out.prompt_token_texts = token_texts(self._tokenizer, self._prompt)
            out.prompt_top_token_texts = [token_texts(self._tokenizer, lp.top_ids) for lp in out.prompt_logprobs]

    def _final_delta(self, delta: TokenDelta) -> TextDelta:
        out = self._take(delta)
        out.finish_reason = delta.finish_reason
        out.matched_stop = delta.matched_stop
        out.error = delta.error
        out.error_code = delta.error_code
        return out

    def _stopped_delta(self, delta: TokenDelta, matched: str, completion_tokens: int) -> TextDelta:
        out = self._take(delta)
        out.finish_reason = FINISH_STOP
        out.matched_stop = matched
        out.completion_tokens = completion_tokens
        return out
