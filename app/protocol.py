"""Every message that crosses a process boundary, declared once, with a fixed field order.

Wire format: msgpack. A message is packed as an ExtType(MESSAGE_EXT, packb([tag, *fields]))
so messages nest (a StepPlan holds SeqChunks) and decode back to the same dataclasses without
pickling. Field order is the wire contract: append new fields at the end, with defaults.

Data path (DESIGN.md section 4):
  http --GenerateRequest--> tokenizer --TokenizedRequest--> scheduler --StepPlan--> worker
  worker --StepResult--> scheduler --TokenDeltas--> tokenizer --TextDeltas--> http
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

MESSAGE_EXT = 1

# Finish reasons, as OpenAI spells them.
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping parameters (OpenAI semantics; -1 top_k = off)."""

    max_new_tokens: int | None = None  # None: up to the remaining context
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # matched in the tokenizer process
    stop_token_ids: list[int] = field(default_factory=list)  # matched in the scheduler
    ignore_eos: bool = False
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: bool = False  # return the sampled token's logprob
    top_logprobs: int = 0  # and this many alternatives per position
    no_stop_trim: bool = False  # keep the matched stop string in the output
    grammar: GrammarSpec | None = None  # structured output: the output must match this (app/grammar)
    # Prompt logprobs: -1 none; else the index of the first prompt token whose logprob is reported (token 0
    # has none: nothing predicts it), with top_logprobs alternatives. Computed in the prefill's forward.
    prompt_logprob_start: int = -1

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-6


@dataclass(slots=True)
class GrammarSpec:
    """A constraint on a request's output (structured output, app/grammar). The HTTP APIs set it from
    response_format / json_schema / regex / ebnf / guided_*; code inside the server (tool calling) may set
    it too. The tokenizer compiles it off the step loop and fills `compiled`; the worker's matcher runs that.

    kind: one of app.grammar.KINDS: "json_schema" (value: the schema as JSON text), "json_object" (any JSON
    object; value ignored), "regex", "ebnf" (GBNF-style, root rule `root`), "structural_tag" (value: an
    XGrammar structural tag as JSON text). param: the request field it came from, named in errors.
    """

    kind: str
    value: str = ""
    param: str = ""
    compiled: str = ""  # the serialized compiled grammar (tokenizer -> worker); empty until compiled


# ---------------------------------------------------------------- http -> tokenizer


@dataclass(slots=True)
class GenerateRequest:
    """A request as the HTTP process received it; exactly one of text / input_ids / messages."""

    rid: str
    sampling: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # chat: the tokenizer applies the template
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    stream: bool = False
    arrival_time: float = 0.0  # time.time() at the HTTP front
    return_prompt_ids: bool = False  # echo / prompt logprobs need the prompt ids back
    tools: list[dict[str, Any]] = field(default_factory=list)  # chat: OpenAI tool definitions, for the template
    parse_tool_calls: bool = False  # chat: run --tool-call-parser over the answer
    parallel_tool_calls: bool = True  # False: only the first call is kept
    separate_reasoning: bool = False  # chat: run --reasoning-parser over the answer
    # A forced tool_choice (its grammar is in sampling): "required" makes the answer a JSON array of
    # {"name", "parameters"}, read by the json tool parser whatever --tool-call-parser is; a named function
    # makes it that tool's arguments object.
    forced_calls: bool = False  # tool_choice "required"
    forced_tool_name: str = ""  # tool_choice {"type": "function", "function": {"name": ...}}


@dataclass(slots=True)
class AbortRequest:
    """Abort one request (rid) or all (abort_all). Flows http -> tokenizer -> scheduler."""

    rid: str | None = None
    abort_all: bool = False
    reason: str = "aborted"


# ---------------------------------------------------------------- tokenizer -> scheduler


@dataclass(slots=True)
class TokenizedRequest:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0


@dataclass(slots=True)
class FinishRequest:
    """The tokenizer matched a stop string: the scheduler finishes the request and frees it."""

    rid: str
    reason: str = FINISH_STOP


# ---------------------------------------------------------------- scheduler <-> worker


@dataclass(slots=True)
class NewSeq:
    """A sequence entering the worker: it gets a slot and keeps its block table on the device.

    num_cached_tokens tokens of it are already in the KV cache (prefix-cache hit); after a
    preemption the sequence re-enters with its prompt plus the tokens generated so far, of
    which the first num_prompt_tokens are the original prompt (penalties count the rest).
    """

    slot: int
    rid: str
    sampling: SamplingParams
    num_prompt_tokens: int
    block_ids: list[int]
    num_cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)  # for repetition penalty


@dataclass(slots=True)
class SeqChunk:
    """Work for one sequence in one step.

    token_ids: the prompt tokens to feed (a prefill chunk); empty means one decode step fed
    with the token the worker sampled last for this slot. append_block_ids extend the slot's
    block table before the step. sample: whether to sample a token after this chunk (False
    for all but the last chunk of a chunked prefill).
    """

    slot: int
    token_ids: list[int] = field(default_factory=list)
    append_block_ids: list[int] = field(default_factory=list)
    sample: bool = True
    # Speculative decoding (a decode chunk only): the worker may verify up to this many draft tokens after
    # the fed one, in the same forward; the slot's blocks cover them. After such a chunk both sides keep
    # the slot's first ceil((seq_len + 1) / block_size) blocks (seq_len: the kept length) and the
    # scheduler frees the rest: the rejected positions' blocks.
    num_draft: int = 0


@dataclass(slots=True)
class StepPlan:
    """One forward step. new_seqs register slots before the step; chunks are the batch, in
    order; free_slots are released after it (finished, aborted or preempted sequences)."""

    step: int
    new_seqs: list[NewSeq] = field(default_factory=list)
    chunks: list[SeqChunk] = field(default_factory=list)
    free_slots: list[int] = field(default_factory=list)


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of the sampled token and the top alternatives, for one position."""

    token_id: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    """Tokens sampled in one step: slots[i] sampled token_ids[i] (only chunks with sample=True)."""

    step: int
    slots: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # empty when none asked
    error: str | None = None  # the step failed: every sequence in it is failed with this
    bad_slots: list[int] = field(default_factory=list)  # slots whose logits were NaN/inf
    # Sequences the worker refused (bad sampling parameters, token ids outside the vocabulary): each
    # fails alone with failed_errors[i]; the worker holds nothing for them (the scheduler frees the KV).
    failed_slots: list[int] = field(default_factory=list)
    failed_errors: list[str] = field(default_factory=list)
    # Prompt logprobs computed in this step: prompt_logprobs[i] continues prompt_slots[i]'s list, in order.
    prompt_slots: list[int] = field(default_factory=list)
    prompt_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)
    # Speculative decoding (empty when no chunk of the step had num_draft > 0), aligned with slots: the
    # draft tokens slots[i] verified and accepted, which come before token_ids[i] (the token sampled after
    # them), and how many drafts it verified.
    accepted_ids: list[list[int]] = field(default_factory=list)
    draft_counts: list[int] = field(default_factory=list)


@dataclass(slots=True)
class WorkerReady:
    """Sent by each worker once its model is loaded and warmed up."""

    rank: int
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    info: dict[str, Any] = field(default_factory=dict)  # start-up figures for logs/metrics


# ---------------------------------------------------------------- scheduler -> tokenizer -> http


@dataclass(slots=True)
class TokenDelta:
    rid: str
    token_ids: list[int]
    finish_reason: str | None = None  # None while running
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    error: str | None = None
    error_code: int = 0  # HTTP status for errors (400 bad request, 500 engine failure)
    # The prompt's logprobs (SamplingParams.prompt_logprob_start on), on the first output token's delta:
    # one per prompt token from max(start, 1) to the end; sent once, preemptions included.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class TokenDeltas:
    deltas: list[TokenDelta]
    time: float = 0.0  # time.time() when the scheduler produced them (per-request latency metrics)


@dataclass(slots=True)
class TextDelta:
    rid: str
    text: str  # new text since the last delta (stop strings already trimmed)
    token_ids: list[int]  # new token ids since the last delta
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)  # per new token, when logprobs asked
    top_token_texts: list[list[str]] = field(default_factory=list)  # per new token, per alternative
    error: str | None = None
    error_code: int = 0
    prompt_ids: list[int] = field(default_factory=list)  # set on the first delta if asked
    prompt_text: str | None = None  # likewise (echo needs the text of token-id prompts)
    reasoning_text: str = ""  # new reasoning since the last delta (--reasoning-parser); text is the answer
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls completed since the last delta
    # Prompt logprobs (first delta only; as TokenDelta.prompt_logprobs) and, with them, the text of every
    # prompt token and of each position's alternatives.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_token_texts: list[str] = field(default_factory=list)
    prompt_top_token_texts: list[list[str]] = field(default_factory=list)


@dataclass(slots=True)
class ToolCall:
    """A tool call parsed from the answer (--tool-call-parser); arguments is a JSON object's text."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class TextDeltas:
    deltas: list[TextDelta]


# ---------------------------------------------------------------- control and lifecycle


DEFAULT_UPDATE_GROUP = "weight_update_group"  # a trainer's broadcast group, when the caller names none

# A control operation is one dataclass below; its KIND names it in logs, errors and route codes. The
# process that runs it: the scheduler (flush_cache, get_loads, pause/continue, the weight operations, which
# it hands to the worker), or the tokenizer (tokenize, detokenize). Each reply's `result` is the typed
# payload named in the operation's docstring (None when it has none).


@dataclass(slots=True)
class FlushCache:
    """Drop the prefix cache's unreferenced blocks."""

    KIND: ClassVar[str] = "flush_cache"


@dataclass(slots=True)
class GetLoads:
    """Each replica's load; result: Loads (one replica's scheduler), AllLoads (the tokenizer to http)."""

    KIND: ClassVar[str] = "get_loads"


@dataclass(slots=True)
class PauseGeneration:
    """Stop stepping; mode: in_place (requests stay as they are), retract (their KV is freed), abort."""

    KIND: ClassVar[str] = "pause_generation"
    mode: str = "in_place"


@dataclass(slots=True)
class ContinueGeneration:
    KIND: ClassVar[str] = "continue_generation"


@dataclass(slots=True)
class UpdateWeightsFromDisk:
    """Reload every weight from a checkpoint of the same model; result: WeightIdentity."""

    KIND: ClassVar[str] = "update_weights_from_disk"
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None  # the scheduler's: applied once the worker succeeded


@dataclass(slots=True)
class InitWeightsUpdateGroup:
    """Join a trainer's broadcast group (the trainer is rank 0; this worker rank_offset + its TP rank)."""

    KIND: ClassVar[str] = "init_weights_update_group"
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_UPDATE_GROUP
    backend: str = "nccl"


@dataclass(slots=True)
class DestroyWeightsUpdateGroup:
    KIND: ClassVar[str] = "destroy_weights_update_group"
    group_name: str = DEFAULT_UPDATE_GROUP


@dataclass(slots=True)
class UpdateWeightsFromDistributed:
    """Receive the named tensors from the trainer's broadcasts; result: WeightIdentity."""

    KIND: ClassVar[str] = "update_weights_from_distributed"
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_UPDATE_GROUP
    flush_cache: bool = True  # the scheduler's, as weight_version
    weight_version: str | None = None


@dataclass(slots=True)
class UpdateWeightsFromTensor:
    """tensors: the bytes of safetensors.torch.save({name: tensor, ...}); result: WeightIdentity."""

    KIND: ClassVar[str] = "update_weights_from_tensor"
    tensors: bytes
    flush_cache: bool = True  # the scheduler's, as weight_version
    weight_version: str | None = None


@dataclass(slots=True)
class StartWeightUpdate:
    """Open a chunked update: the engine drains and does not step until FinishWeightUpdate."""

    KIND: ClassVar[str] = "start_weight_update"


@dataclass(slots=True)
class FinishWeightUpdate:
    """Close a chunked update, applying its version and cache flush; result: WeightIdentity."""

    KIND: ClassVar[str] = "finish_weight_update"
    weight_version: str | None = None


@dataclass(slots=True)
class Tokenize:
    """Encode prompts, or one chat (messages) rendered by the template; result: Tokenized."""

    KIND: ClassVar[str] = "tokenize"
    prompts: list[str] = field(default_factory=list)
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] = field(default_factory=list)
    add_special_tokens: bool = True
    return_token_strs: bool = False


@dataclass(slots=True)
class Detokenize:
    """Decode each list of token ids; result: Detokenized."""

    KIND: ClassVar[str] = "detokenize"
    tokens: list[list[int]] = field(default_factory=list)
    skip_special_tokens: bool = False


ControlOp = (FlushCache | GetLoads | PauseGeneration | ContinueGeneration | UpdateWeightsFromDisk
             | InitWeightsUpdateGroup | DestroyWeightsUpdateGroup | UpdateWeightsFromDistributed
             | UpdateWeightsFromTensor | StartWeightUpdate | FinishWeightUpdate | Tokenize | Detokenize)


@dataclass(slots=True)
class Loads:
    """One data-parallel replica's load, as its scheduler reports it (/v1/loads)."""

    dp_rank: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_used_blocks: int
    num_cached_blocks: int
    num_blocks: int
    num_preemptions: int
    paused: bool
    weight_update_in_progress: bool
    queued_control_ops: int


@dataclass(slots=True)
class AllLoads:
    replicas: list[Loads] = field(default_factory=list)  # in replica order


@dataclass(slots=True)
class WeightIdentity:
    """What a weight change set (None: unchanged): http stamps later responses with it."""

    weight_version: str | None = None
    model_path: str | None = None


@dataclass(slots=True)
class Tokenized:
    tokens: list[list[int]] = field(default_factory=list)  # one list per prompt
    token_strs: list[list[str]] | None = None  # when return_token_strs


@dataclass(slots=True)
class Detokenized:
    texts: list[str] = field(default_factory=list)


ControlResult = Loads | AllLoads | WeightIdentity | Tokenized | Detokenized


@dataclass(slots=True)
class ControlRequest:
    """A control operation routed http -> tokenizer (-> each replica's scheduler -> worker); the answer is
    a ControlReply with the same req_id."""

    req_id: str
    op: ControlOp

    @property
    def kind(self) -> str:
        """The operation's name (its type's, for something that is no operation: the receiver refuses it)."""
        return getattr(self.op, "KIND", type(self.op).__name__)


@dataclass(slots=True)
class ControlReply:
    req_id: str
    success: bool
    message: str = ""
    result: ControlResult | None = None


@dataclass(slots=True)
class EngineInfo:
    """What the engine can serve, as the tokenizer and http check requests against it (admission) and
    report it. The worker (TP rank 0 of replica 0) fills the model's and sampler's fields, the
    tokenizer max_token_chars, the supervisor the rest."""

    max_model_len: int = 0
    vocab_size: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    num_blocks: int = 0
    block_size: int = 0
    sampling_backend: str | None = None  # --sampling-backend (None: the portable torch sampler)
    max_top_logprobs: int = 0  # the most alternatives per position the sampler reports
    max_token_chars: int | None = None  # the longest token's text (None: --skip-tokenizer-init)
    served_model_name: str = ""
    enable_metrics: bool = False
    startup_seconds: float = 0.0


@dataclass(slots=True)
class ProcessReady:
    """A child tells the supervisor it is up; info carries start-up figures for logs and metrics,
    engine what admission needs (the worker leader's and the tokenizer's parts of EngineInfo)."""

    name: str
    pid: int
    info: dict[str, Any] = field(default_factory=dict)
    engine: EngineInfo | None = None


@dataclass(slots=True)
class EngineReady:
    """Supervisor -> tokenizer -> http: every process is up and warmed up; info is the engine's
    start-up figures (for /get_server_info and metrics), engine what requests are checked against
    (None on a worker node's health-only http)."""

    info: dict[str, Any] = field(default_factory=dict)
    engine: EngineInfo | None = None


@dataclass(slots=True)
class Shutdown:
    """Supervisor -> a child: stop now (used where a signal cannot reach a thread loop)."""

    reason: str = ""


@dataclass(slots=True)
class StartupPhase:
    """A process -> the supervisor -> http: a start-up phase began (done False) or ended after `seconds`;
    /readiness shows where start-up is (app/startup_phases.py)."""

    name: str  # the process: worker0, supervisor, ...
    phase: str
    seconds: float = 0.0
    done: bool = False


# ---------------------------------------------------------------- codec

MESSAGE_TYPES: list[type] = [
    SamplingParams,
    GenerateRequest,
    AbortRequest,
    TokenizedRequest,
    FinishRequest,
    NewSeq,
    SeqChunk,
    StepPlan,
    TokenLogprobs,
    StepResult,
    WorkerReady,
    TokenDelta,
    TokenDeltas,
    TextDelta,
    TextDeltas,
    ControlRequest,
    ControlReply,
    ProcessReady,
    EngineReady,
    Shutdown,
    StartupPhase,
    EngineInfo,
    ToolCall,  # appended: the tags above are the wire contract
    GrammarSpec,  # appended
    # The control operations and their results (ControlRequest.op, ControlReply.result).
    FlushCache,
    GetLoads,
    PauseGeneration,
    ContinueGeneration,
    UpdateWeightsFromDisk,
    InitWeightsUpdateGroup,
    DestroyWeightsUpdateGroup,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
    StartWeightUpdate,
    FinishWeightUpdate,
    Tokenize,
    Detokenize,
    Loads,
    AllLoads,
    WeightIdentity,
    Tokenized,
    Detokenized,
]
_TAG_OF: dict[type, int] = {cls: i for i, cls in enumerate(MESSAGE_TYPES)}
_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in MESSAGE_TYPES
}


class ProtocolError(ValueError):
    pass


def _default(obj: Any) -> Any:
    tag = _TAG_OF.get(type(obj))
    if tag is None:
        raise TypeError(f"cannot encode {type(obj).__name__} on the wire")
    values = [getattr(obj, name) for name in _FIELDS[type(obj)]]
    return msgpack.ExtType(MESSAGE_EXT, msgpack.packb([tag, *values], default=_default))


def _ext_hook(code: int, data: bytes) -> Any:
    if code != MESSAGE_EXT:
        raise ProtocolError(f"unknown msgpack ext code {code}")
    tag, *values = msgpack.unpackb(data, ext_hook=_ext_hook, strict_map_key=False)
    if not 0 <= tag < len(MESSAGE_TYPES):
        raise ProtocolError(f"unknown message tag {tag}")
    cls = MESSAGE_TYPES[tag]
    return cls(*values)


def encode(msg: Any) -> bytes:
    return msgpack.packb(msg, default=_default)


def decode(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"malformed message: {exc}") from exc

