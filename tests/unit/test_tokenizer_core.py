"""The tokenizer state machine, driven directly with protocol messages (no sockets)."""

from __future__ import annotations

from app.protocol import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    Detokenize,
    Detokenized,
    EngineInfo,
    EngineReady,
    FinishRequest,
    FlushCache,
    GenerateRequest,
    SamplingParams,
    TextDelta,
    TextDeltas,
    TokenDelta,
    TokenDeltas,
    Tokenize,
    Tokenized,
    TokenizedRequest,
    TokenLogprobs,
    WorkerReady,
)
from app.tokenizer.core import HTTP, SCHEDULER, Outgoing, TokenizerCore

MAX_MODEL_LEN = 64


def make_core(tok, *, stream_interval: int = 1, ready: bool = True) -> TokenizerCore:
    core = TokenizerCore(tok, stream_interval=stream_interval)
    if ready:
        ready_msg = EngineReady(engine=EngineInfo(max_model_len=MAX_MODEL_LEN, vocab_size=512, eos_token_ids=[2],
                                                  max_top_logprobs=20))
        assert core.handle(ready_msg) == [Outgoing("http", ready_msg)]  # http learns readiness from us
    return core


def submit(core, rid="r1", *, stream=True, **sampling_kw) -> TokenizedRequest:
    text = sampling_kw.pop("text", "Hello")
    extra = sampling_kw.pop("extra", {})
    out = core.handle(GenerateRequest(rid=rid, sampling=SamplingParams(**sampling_kw), text=text,
                                      stream=stream, **extra))
    assert len(out) == 1 and out[0].dest == SCHEDULER, out
    assert isinstance(out[0].msg, TokenizedRequest)
    return out[0].msg


def feed(core, rid, ids, *, completion, finish=None, matched=None, **kw) -> tuple[list[TextDelta], list]:
    """One TokenDeltas message; returns (text deltas sent to http, messages sent to the scheduler)."""
    delta = TokenDelta(rid=rid, token_ids=list(ids), finish_reason=finish, matched_stop=matched,
                       prompt_tokens=3, completion_tokens=completion, **kw)
    out = core.handle(TokenDeltas([delta]))
    http = [d for o in out if o.dest == HTTP for d in o.msg.deltas]
    sched = [o.msg for o in out if o.dest == SCHEDULER]
    return http, sched


def stream_tokens(core, rid, ids, *, finish="length"):
    """One token per TokenDeltas, the last one terminal; all text deltas and scheduler messages."""
    deltas, sched = [], []
    for i, tid in enumerate(ids):
        last = i == len(ids) - 1
        d, s = feed(core, rid, [tid], completion=i + 1, finish=finish if last else None)
        deltas += d
        sched += s
    return deltas, sched


def errors_of(out) -> list[TextDelta]:
    assert len(out) == 1 and out[0].dest == HTTP and isinstance(out[0].msg, TextDeltas)
    return out[0].msg.deltas


# ---------------------------------------------------------------- admission


def test_request_before_engine_ready_is_refused(tok):
    core = make_core(tok, ready=False)
    [err] = errors_of(core.handle(GenerateRequest(rid="a", sampling=SamplingParams(), text="hi")))
    assert (err.finish_reason, err.error_code) == ("abort", 503)


def test_text_request_is_tokenized_and_forwarded(tok):
    core = make_core(tok)
    sent = submit(core, text="Hello, world!", max_new_tokens=None)
    assert sent.prompt_ids == tok.encode("Hello, world!")
    assert sent.sampling.max_new_tokens is None  # the scheduler fills the remaining context
    assert core.num_live_requests == 1


def test_chat_request_uses_the_template(tok):
    core = make_core(tok)
    msgs = [{"role": "user", "content": "Hi"}]
    out = core.handle(GenerateRequest(rid="c", sampling=SamplingParams(), messages=msgs))
    assert tok.decode(out[0].msg.prompt_ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_too_long_prompt_gets_a_400_delta(tok):
    core = make_core(tok)
    req = GenerateRequest(rid="long", sampling=SamplingParams(max_new_tokens=10), input_ids=[5] * 60)
    [err] = errors_of(core.handle(req))
    assert (err.rid, err.finish_reason, err.error_code) == ("long", "abort", 400)
    assert "60 tokens and 10 new tokens" in err.error and str(MAX_MODEL_LEN) in err.error
    assert core.num_live_requests == 0


def test_bad_input_id_gets_a_400_delta(tok):
    core = make_core(tok)
    [err] = errors_of(core.handle(GenerateRequest(rid="x", sampling=SamplingParams(), input_ids=[1, 512])))
    assert err.error_code == 400 and "[0, 512)" in err.error


def test_empty_stop_string_gets_a_400_delta(tok):
    core = make_core(tok)
    [err] = errors_of(core.handle(GenerateRequest(rid="x", sampling=SamplingParams(stop=[""]), text="hi")))
    assert err.error_code == 400 and "stop strings" in err.error


def test_duplicate_rid_is_refused(tok):
    core = make_core(tok)
    submit(core, "dup")
    [err] = errors_of(core.handle(GenerateRequest(rid="dup", sampling=SamplingParams(), text="hi")))
    assert err.error_code == 400 and "already in use" in err.error


# ---------------------------------------------------------------- streaming


def test_streaming_first_token_then_every_interval(tok):
    core = make_core(tok, stream_interval=3)
    submit(core)
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    assert len(ids) >= 8
    deltas, sched = stream_tokens(core, "r1", ids)
    sizes = [len(d.token_ids) for d in deltas]
    assert sizes[0] == 1 and all(s == 3 for s in sizes[1:-1]) and sum(sizes) == len(ids)
    assert "".join(d.text for d in deltas) == "The quick brown fox jumps over the lazy dog."
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]
    assert deltas[-1].completion_tokens == len(ids) and deltas[-1].prompt_tokens == 3
    assert sched == [] and core.num_live_requests == 0


def test_non_streaming_request_gets_one_delta(tok):
    core = make_core(tok)
    submit(core, stream=False)
    ids = tok.encode("Caf\u00e9 \U0001f600 ok")
    deltas, _ = stream_tokens(core, "r1", ids)
    assert len(deltas) == 1
    assert (deltas[0].text, deltas[0].token_ids, deltas[0].finish_reason) == ("Caf\u00e9 \U0001f600 ok", ids, "length")


def test_split_character_arrives_whole(tok):
    core = make_core(tok)
    submit(core)
    ids = tok.encode("a\U0001f680")
    deltas, _ = stream_tokens(core, "r1", ids, finish="length")
    texts = [d.text for d in deltas]
    assert "".join(texts) == "a\U0001f680" and "\U0001f680" in texts and "\ufffd" not in "".join(texts)


def test_eos_token_text_is_dropped_unless_no_stop_trim(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for no_trim, expected in ((False, "Hi"), (True, "Hi<|im_end|>")):
        core = make_core(tok)
        submit(core, stream=False, skip_special_tokens=False, no_stop_trim=no_trim)
        ids = [*tok.encode("Hi"), eos]
        [final], _ = feed(core, "r1", ids, completion=len(ids), finish="stop", matched=eos)
        assert (final.text, final.matched_stop, final.token_ids) == (expected, eos, ids)


# ---------------------------------------------------------------- stop strings


def test_stop_string_finishes_and_tells_the_scheduler(tok):
    core = make_core(tok)
    submit(core, stop=["fox"])
    ids = tok.encode("The quick brown fox jumps")
    deltas, sched = [], []
    for i, tid in enumerate(ids):
        d, s = feed(core, "r1", [tid], completion=i + 1)
        deltas += d
        sched += s
    assert sched == [FinishRequest("r1")]
    final = deltas[-1]
    assert (final.finish_reason, final.matched_stop) == ("stop", "fox")
    assert "".join(d.text for d in deltas) == "The quick brown "
    n = final.completion_tokens
    assert tok.decode(ids[:n]).endswith("fox") and not tok.decode(ids[: n - 1]).endswith("fox")
    assert core.num_live_requests == 0
    # The scheduler's later deltas for it are ignored.
    assert feed(core, "r1", [5], completion=n + 1, finish="abort") == ([], [])


def test_stop_inside_a_multi_token_delta_trims_ids_and_counts(tok):
    core = make_core(tok)
    submit(core, stream=False, stop=["brown"], extra={"return_prompt_ids": False})
    ids = tok.encode("The quick brown fox jumps")
    [final], sched = feed(core, "r1", ids, completion=len(ids))
    assert sched == [FinishRequest("r1")]
    assert final.text == "The quick " and final.matched_stop == "brown"
    assert final.token_ids == ids[: final.completion_tokens]
    assert tok.decode(final.token_ids).endswith("brown")


def test_stop_string_kept_with_no_stop_trim(tok):
    core = make_core(tok)
    submit(core, stream=False, stop=["brown"], no_stop_trim=True)
    ids = tok.encode("The quick brown fox")
    [final], _ = feed(core, "r1", ids, completion=len(ids))
    assert final.text == "The quick brown"


def test_partial_stop_is_released_at_the_end(tok):
    core = make_core(tok)
    submit(core, stop=["dog!"])
    ids = tok.encode("lazy dog")
    deltas, sched = stream_tokens(core, "r1", ids, finish="length")
    assert "".join(d.text for d in deltas) == "lazy dog" and sched == []
    assert deltas[-1].finish_reason == "length"


# ---------------------------------------------------------------- pass-through and extras


def test_abort_is_forwarded_and_the_terminal_delta_still_reaches_http(tok):
    core = make_core(tok)
    submit(core)
    abort = AbortRequest(rid="r1", reason="client went away")
    assert [(o.dest, o.msg) for o in core.handle(abort)] == [(SCHEDULER, abort)]
    assert core.num_live_requests == 1
    [final], _ = feed(core, "r1", [], completion=0, finish="abort", error="client went away", error_code=0)
    assert (final.finish_reason, final.error) == ("abort", "client went away")
    assert core.num_live_requests == 0


def test_scheduler_error_is_copied(tok):
    core = make_core(tok)
    submit(core)
    [final], _ = feed(core, "r1", [], completion=0, finish="abort", error="engine failure", error_code=500)
    assert (final.error, final.error_code) == ("engine failure", 500)


def test_control_messages_are_routed(tok):
    core = make_core(tok)
    req = ControlRequest(req_id="c1", op=FlushCache())
    reply = ControlReply(req_id="c1", success=True)
    assert [(o.dest, o.msg) for o in core.handle(req)] == [(SCHEDULER, req)]
    assert [(o.dest, o.msg) for o in core.handle(reply)] == [(HTTP, reply)]


def test_tokenize_is_answered_by_the_tokenizer_itself(tok):
    core = make_core(tok)
    [out] = core.handle(ControlRequest(req_id="t1", op=Tokenize(prompts=["Hello"], return_token_strs=True)))
    ids = list(tok.encode("Hello"))
    assert out.dest == HTTP and out.msg.success
    assert out.msg.result == Tokenized([ids], [tok.convert_ids_to_tokens(ids)])
    [out] = core.handle(ControlRequest(req_id="t2", op=Detokenize(tokens=[ids])))
    assert out.msg.result == Detokenized([tok.decode(ids)])


def test_unexpected_message_is_dropped(tok):
    core = make_core(tok)
    assert core.handle(WorkerReady(0, 1, 16, 64, 512, [2])) == []
    assert core.handle({"not": "a message"}) == []


def test_logprob_token_texts(tok):
    core = make_core(tok)
    submit(core, stream=False, logprobs=True, top_logprobs=2)
    ids = tok.encode("Hello world")
    alt = tok.encode(" the")[:1]
    lps = [TokenLogprobs(t, -0.5, top_ids=[t, alt[0]], top_logprobs=[-0.5, -1.0]) for t in ids]
    [final], _ = feed(core, "r1", ids, completion=len(ids), finish="length", logprobs=lps)
    assert final.logprobs == lps
    assert "".join(final.token_texts) == "Hello world"
    assert final.top_token_texts[0] == [final.token_texts[0], tok.decode(alt)]


def test_prompt_ids_on_the_first_delta_only(tok):
    core = make_core(tok)
    sent = submit(core, text="Hi there", extra={"return_prompt_ids": True})
    ids = tok.encode(" ok.")
    deltas, _ = stream_tokens(core, "r1", ids)
    assert (deltas[0].prompt_ids, deltas[0].prompt_text) == (sent.prompt_ids, "Hi there")
    assert all(d.prompt_ids == [] and d.prompt_text is None for d in deltas[1:])


def test_skip_tokenizer_init(tok):
    core = TokenizerCore(None)
    core.handle(EngineReady(engine=EngineInfo(max_model_len=MAX_MODEL_LEN, vocab_size=512, eos_token_ids=[2])))
    [err] = errors_of(core.handle(GenerateRequest(rid="t", sampling=SamplingParams(), text="hi")))
    assert err.error_code == 400 and "--skip-tokenizer-init" in err.error
    req = GenerateRequest(rid="s", sampling=SamplingParams(stop=["x"]), input_ids=[1, 2])
    [err] = errors_of(core.handle(req))
    assert err.error_code == 400 and "--skip-tokenizer-init" in err.error
    out = core.handle(GenerateRequest(rid="i", sampling=SamplingParams(), input_ids=[1, 2], stream=True))
    assert out[0].msg.prompt_ids == [1, 2]
    deltas, _ = stream_tokens(core, "i", [7, 8, 9])
    assert [d.token_ids for d in deltas] == [[7], [8], [9]] and all(d.text == "" for d in deltas)


def test_a_failing_delta_fails_only_its_request(tok, monkeypatch):
    core = make_core(tok)
    submit(core, "bad")
    submit(core, "good")
    state = core._requests["bad"]
    monkeypatch.setattr(state, "on_delta", lambda delta: 1 / 0)
    out = core.handle(TokenDeltas([TokenDelta("bad", [5], completion_tokens=1),
                                   TokenDelta("good", tok.encode("ok"), completion_tokens=1)]))
    http = [d for o in out if o.dest == HTTP for d in o.msg.deltas]
    sched = [o.msg for o in out if o.dest == SCHEDULER]
    assert [(d.rid, d.error_code) for d in http] == [("bad", 500), ("good", 0)]
    assert sched == [AbortRequest(rid="bad", reason="detokenization failed")]
    assert core.num_live_requests == 1
