"""Request bodies of /v1/completions and /v1/chat/completions, validated strictly, and their mapping to
engine requests. OpenAI parameters this server does not build are refused by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from app.http.body import StrictBody, fits_the_wire, validate
from app.http.errors import APIError, bad_request, unsupported
from app.http.sampling import (
    MaxTokens,
    NumChoices,
    NumLogprobs,
    SamplingBody,
    check_token_ids,
    renamed_fields,
)
from app.http.structured import openai_grammar
from app.http.tools import (
    ToolDef,
    check_tools,
    forced_grammar,
    forced_tool_name,
    is_forced,
    parse_tool_choice,
)
from app.protocol import GrammarSpec, SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default

# OpenAI parameters that are not built, with the values that mean "not used" (always accepted).
_NOT_BUILT_COMPLETIONS: dict[str, Callable[[Any], bool]] = {
    "suffix": lambda v: v in (None, ""),
}
_NOT_BUILT_CHAT: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: v in (None, []),
    "function_call": lambda v: v in (None, "none"),
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "service_tier": lambda v: v in (None, "auto", "default"),
    "store": lambda v: v in (None, False),
    "metadata": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "prompt_cache_key": lambda v: v is None,
    "prompt_cache_options": lambda v: v is None,
    "prompt_cache_retention": lambda v: v is None,
    "moderation": lambda v: v is None,
    "safety_identifier": lambda v: v is None,
    "verbosity": lambda v: v is None,
}


# vLLM's and SGLang's request extensions that are not built, with their "not used" values; the ones that
# are built are fields below (top_k, min_p, ..., include_stop_str_in_output, continue_final_message).
_NOT_BUILT_EXTENSIONS: dict[str, Callable[[Any], bool]] = {
    "use_beam_search": lambda v: v in (None, False),
    "length_penalty": lambda v: v in (None, 1, 1.0),
    "priority": lambda v: v in (None, 0),
    "truncate_prompt_tokens": lambda v: v is None,
    "return_tokens_as_token_ids": lambda v: v in (None, False),
    "return_token_ids": lambda v: v in (None, False),
    "allowed_token_ids": lambda v: v is None,
    "bad_words": lambda v: v in (None, []),
    "request_id": lambda v: v is None,
    "cache_salt": lambda v: v is None,
    "kv_transfer_params": lambda v: v is None,
    "vllm_xargs": lambda v: v is None,
    "lora_path": lambda v: v is None,
    "return_hidden_states": lambda v: v in (None, False),
    "mm_processor_kwargs": lambda v: v in (None, {}),
}
_NOT_BUILT_CHAT_EXTENSIONS: dict[str, Callable[[Any], bool]] = {
    "documents": lambda v: v in (None, []),
    "chat_template": lambda v: v is None,  # the server's --chat-template or the model's own applies
    "stream_reasoning": lambda v: v in (None, True),
}
_NOT_BUILT_COMPLETIONS.update(_NOT_BUILT_EXTENSIONS)
_NOT_BUILT_CHAT.update(_NOT_BUILT_EXTENSIONS)
_NOT_BUILT_CHAT.update(_NOT_BUILT_CHAT_EXTENSIONS)


def drop_not_built(body: dict[str, Any], not_built: dict[str, Callable[[Any], bool]]) -> dict[str, Any]:
    """Refuse a parameter we do not build unless its value means 'not used'; drop it then."""
    for name, unused in not_built.items():
        if name in body and not unused(body[name]):
            raise unsupported(name)
    return {k: v for k, v in body.items() if k not in not_built}


class StreamOptions(StrictBody):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM: usage in every chunk, not only in a last one


# OpenAI's names for the shared sampling fields that the engine names otherwise.
OPENAI_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


class SamplingFields(SamplingBody):
    """What completions and chat share: the sampling fields (OpenAI's names), and these."""

    model_config = renamed_fields(OPENAI_RENAMES)

    model: str | None = None  # absent: the served model (as vLLM answers)
    n: NumChoices | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted as OpenAI does (end-user id); shown in request logs only
    include_stop_str_in_output: bool | None = None  # vLLM's name for no_stop_trim
    # Structured output (app/http/structured.py): OpenAI's response_format, or vLLM clients' fields.
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @field_validator("model", mode="before")
    @classmethod
    def _model_or_absent(cls, value: Any) -> Any:
        if value is None:  # only an absent model means the served one
            raise ValueError("must be a string (leave it out for the served model)")
        return value

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling(self, vocab_size: int | None, max_tokens: int | None, top_logprobs: int | None) -> SamplingParams:
        """top_logprobs None: no logprobs; k >= 0: the sampled token's logprob and k alternatives."""
        return self.to_params(vocab_size, "", max_tokens, top_logprobs,
                              no_stop_trim=bool(self.include_stop_str_in_output or self.no_stop_trim))

    def grammar(self, prefix: str) -> GrammarSpec | None:
        guided = {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                  "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar}
        return openai_grammar(self.response_format, guided, self.structured_outputs)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


# ---------------------------------------------------------------- completions


Prompt = str | list[int]


def normalize_prompt(value: Any) -> list[Prompt]:
    """str | [str] | [int] | [[int]] (or a mix of strings and id lists) -> one prompt per choice group."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_token_id(t) for t in value):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    elif isinstance(value, list):
        raise ValueError("must not be empty")
    else:
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise ValueError(f"prompt {i} is an empty string")
        elif isinstance(item, list) and all(_is_token_id(t) for t in item):
            if not item:
                raise ValueError(f"prompt {i} is an empty list of token ids")
        else:
            raise ValueError(f"prompt {i} must be a string or a list of non-negative token ids")
    return items


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class CompletionBody(SamplingFields):
    prompt: Any = Field(default=...)
    echo: bool | None = None
    logprobs: NumLogprobs | None = None
    best_of: int | None = None

    _prompt = field_validator("prompt")(normalize_prompt)

    @property
    def prompts(self) -> list[Prompt]:
        return self.prompt


def parse_completion(body: dict[str, Any], vocab_size: int | None) -> tuple[CompletionBody, SamplingParams]:
    parsed = validate(CompletionBody, drop_not_built(body, _NOT_BUILT_COMPLETIONS))
    parsed.check_common()
    n = parsed.n or 1
    if parsed.best_of is not None and parsed.best_of != n:
        raise unsupported("best_of", "only best_of equal to n is supported")
    for i, prompt in enumerate(parsed.prompts):
        if isinstance(prompt, list):
            check_token_ids(prompt, vocab_size, "prompt" if len(parsed.prompts) == 1 else f"prompt[{i}]")
    max_tokens = _or(parsed.max_new_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
    sampling = parsed.sampling(vocab_size, max_tokens, parsed.logprobs)
    if parsed.echo and parsed.logprobs is not None:  # the echoed prompt's logprobs come first, as in vLLM
        sampling.prompt_logprob_start = 0
    return parsed, sampling


# ---------------------------------------------------------------- chat

_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class CalledFunction(StrictBody):
    name: str
    arguments: str


class AssistantToolCall(StrictBody):
    """A call an earlier answer made, sent back in the conversation."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(StrictBody):
    role: str
    tool_calls: list[AssistantToolCall] | None = None  # an assistant turn's calls (before content: it reads them)
    content: Any = Field(default=None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an earlier answer's reasoning, copied back: templates may use it
    # Fields clients copy back from earlier responses; only their empty values are accepted.
    function_call: Any = None
    refusal: Any = None
    audio: Any = None
    annotations: Any = None

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        if value == "function":
            raise ValueError("role 'function' (OpenAI's deprecated function calling) is not supported: "
                             "use role 'tool'")
        if value not in _CHAT_ROLES:
            raise ValueError(f"must be one of {', '.join(_CHAT_ROLES)}")
        return value

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any, info: ValidationInfo) -> str | None:
        if value is None:
            if info.data.get("role") == "assistant" and info.data.get("tool_calls"):
                return None
            raise ValueError("a message needs content (only an assistant turn with tool_calls may omit it)")
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of content parts")
        texts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content part {i} of type {kind!r} is not supported: text only")
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise ValueError(f"content part {i} must be {{\"type\": \"text\", \"text\": <string>}}")
            texts.append(part["text"])
        return "\n".join(texts)

    @field_validator("function_call", "refusal", "audio", "annotations")
    @classmethod
    def _unused(cls, value: Any) -> Any:
        if value not in (None, []):
            raise ValueError("is not supported by this server (function_call: use tool_calls; audio and "
                             "refusals are not built)")
        return None

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message may carry tool_calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only a tool message may carry tool_call_id")
        return self

    def to_engine(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' conventions)."""
        # A call-only turn's null content goes as "": templates that concatenate content would fail on null.
        out: dict[str, Any] = {"role": self.role, "content": self.content if self.content is not None else ""}
        for name in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return out


class ChatBody(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: NumLogprobs | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Any = None  # ToolChoice, checked by parse_tool_choice
    parallel_tool_calls: bool | None = None
    separate_reasoning: bool | None = None  # SGLang: false keeps the reasoning inside content
    include_reasoning: bool | None = None  # vLLM: false drops the reasoning (content is the answer only)
    add_generation_prompt: bool | None = None  # vLLM: false renders no assistant header
    continue_final_message: bool | None = None  # vLLM: the answer continues the last (assistant) message

    _tool_choice = field_validator("tool_choice", mode="before")(parse_tool_choice)

    _fits_the_wire = field_validator("chat_template_kwargs")(fits_the_wire)


def parse_chat(body: dict[str, Any], vocab_size: int | None) -> tuple[ChatBody, SamplingParams]:
    parsed = validate(ChatBody, drop_not_built(body, _NOT_BUILT_CHAT))
    parsed.check_common()
    if parsed.top_logprobs is not None and not parsed.logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    check_tools(parsed.tools, parsed.tool_choice)
    if parsed.continue_final_message and parsed.add_generation_prompt:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                          param="continue_final_message")
    top = (parsed.top_logprobs or 0) if parsed.logprobs else None
    max_tokens = parsed.max_completion_tokens if parsed.max_completion_tokens is not None else parsed.max_new_tokens
    return parsed, _with_forced_tools(parsed, parsed.sampling(vocab_size, max_tokens, top))


def _with_forced_tools(body: ChatBody, sampling: SamplingParams) -> SamplingParams:
    """A forced tool_choice is the request's output constraint: it excludes any other (response_format...)."""
    forced = forced_grammar(body.tools or [], body.tool_choice, parallel=body.parallel_tool_calls is not False)
    if forced is None:
        return sampling
    if sampling.grammar is not None:
        other = sampling.grammar.param.split(".")[0]
        raise bad_request(f"'tool_choice' and '{other}' cannot be combined: a forced tool choice constrains the "
                          f"output to a tool call; leave out '{other}' or send tool_choice 'auto'", param=other)
    return dataclasses.replace(sampling, grammar=forced)


def engine_tool_fields(body: ChatBody, tool_call_parser: str | None, reasoning_parser: str | None) -> dict[str, Any]:
    """The GenerateRequest fields that carry the request's tools and which parsers run over the answer."""
    tools = [t.to_engine() for t in body.tools or []]
    parse = bool(tools) and body.tool_choice != "none"
    forced = is_forced(body.tool_choice)  # the forced output's own format is parsed: no parser needed
    if parse and tool_call_parser is None and not forced:
        raise bad_request("'tools' need a tool-call parser: start the server with --tool-call-parser (or send "
                          "tool_choice 'none' to only show the tools to the model, or 'required')", param="tools")
    # A forced answer is a call from its first token: there is no reasoning to split off.
    separate = reasoning_parser is not None and body.separate_reasoning is not False and not forced
    return {"tools": tools, "parse_tool_calls": parse, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "separate_reasoning": separate, "forced_calls": body.tool_choice == "required",
            "forced_tool_name": forced_tool_name(body.tool_choice)}


def engine_template_fields(body: ChatBody) -> dict[str, Any]:
    """How the chat template renders: kwargs, the generation prompt, continuing the final message."""
    kwargs = dict(body.chat_template_kwargs or {})
    if body.continue_final_message:
        kwargs["continue_final_message"] = True  # apply_chat_template's own argument
    generation_prompt = not body.continue_final_message and body.add_generation_prompt is not False
    return {"chat_template_kwargs": kwargs, "add_generation_prompt": generation_prompt}


def check_model(model: str | None, names: tuple[str, ...]) -> None:
    if model is not None and model not in names:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{names[0]}'",
                       param="model", code="model_not_found")


def with_seed(sampling: SamplingParams, seed: int | None) -> SamplingParams:
    return dataclasses.replace(sampling, seed=seed)
