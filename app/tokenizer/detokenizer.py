"""Incremental detokenization: token ids in, text deltas out, never a broken UTF-8 character.

Each step decodes only a small window of ids: `prefix` (ids whose text was already emitted, kept
as context so that decoders which depend on neighbours, such as SentencePiece's leading-space
handling, see the same surroundings) plus the ids not yet emitted. The delta is the window's
text past the prefix's text. While the window's text ends in U+FFFD (a multi-byte character
split across tokens), nothing is emitted; the next token completes it. After an emission the
window slides forward, so the work per token stays constant however long the output grows.

For tokenizers whose decode is a function of the concatenated bytes (byte-level BPE), the
concatenation of all deltas equals tokenizer.decode(all_ids) with the same flags.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as initial context: enough for leading-space decisions at the first token.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Per-request streaming decoder. add() per new ids, flush() once at the end."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens
        self._ids: list[int] = []  # the window: ids[:read] emitted (context), ids[read:] pending
        self._read = 0
        self._prefix_text = ""
        self._prime(list(prompt_ids[-CONTEXT_TOKENS:]))

    def _prime(self, context: list[int]) -> None:
        """Start with the prompt's tail as context, unless it ends inside a character."""
        if not context:
            return
        text = self._decode(context)
        if text.endswith(REPLACEMENT_CHAR):
            return
        self._ids, self._read, self._prefix_text = context, len(context), text

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of tokenization spaces: it rewrites text across window edges (" ." -> "."),
        # which a stream cannot take back once sent.
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            spaces_between_special_tokens=self._spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new ids; return the text that became final (possibly empty)."""
        self._ids.extend(token_ids)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """The request ended: release whatever is held back, broken characters included."""
        if len(self._ids) == self._read:
            return ""
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text):
            self._slide()
            return ""
        return self._emit(text)

    def _emit(self, text: str) -> str:
        delta = text[len(self._prefix_text):]
        self._slide()
        return delta

    def _slide(self) -> None:
        """The emitted ids become the next window's context; older ids are dropped."""
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)


def token_texts(tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
    """The text of each token on its own (special tokens shown), as logprobs report it."""
    return [tokenizer.decode([tid], skip_special_tokens=False) for tid in token_ids]
