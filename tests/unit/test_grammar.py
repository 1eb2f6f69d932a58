"""Structured output's parts alone: the compile cache, the compiler's errors, the tokenizer's compile
service, the worker's matchers and masks, and the HTTP fields' mapping (app/grammar, app/http/structured.py)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from app.grammar import GrammarError, check_request
from app.grammar.cache import GrammarCache, Outcome
from app.grammar.compiler import Compiler, tokenizer_info
from app.http.errors import APIError
from app.http.structured import native_grammar, openai_grammar
from app.protocol import (
    AbortRequest,
    EngineInfo,
    EngineReady,
    GenerateRequest,
    GrammarSpec,
    SamplingParams,
    TextDeltas,
    TokenizedRequest,
    decode,
    encode,
)
from app.tokenizer.core import SCHEDULER, TokenizerCore
from app.tokenizer.grammar import GrammarService
from app.worker.sampling.grammar import GrammarRows

VOCAB = 512
EOS = 2


@pytest.fixture(scope="module")
def compiler(tok) -> Compiler:
    return Compiler(tokenizer_info(tok, VOCAB, [EOS]))


# ---------------------------------------------------------------- cache


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 40), st.booleans()), max_size=40),
       st.integers(0, 4), st.integers(0, 60))
def test_cache_keeps_its_bounds_and_recency(ops, max_entries, max_bytes) -> None:
    cache = GrammarCache(max_entries, max_bytes)
    model: dict[tuple[str, str], Outcome] = {}  # what a fresh put / get must see
    for key_id, size, is_get in ops:
        key = ("regex", str(key_id))
        if is_get:
            got = cache.get(key)
            assert got is None or got == model[key]
        else:
            outcome = Outcome(compiled="x" * size)
            cache.put(key, outcome)
            model[key] = outcome
            fits = size <= max_bytes and max_entries > 0
            assert (cache.get(key) == outcome) == fits  # the newest entry that fits is kept
        cache.check_invariants()


def test_cache_evicts_the_least_recently_used() -> None:
    cache = GrammarCache(2, 100)
    a, b, c = ("regex", "a"), ("regex", "b"), ("regex", "c")
    cache.put(a, Outcome("1"))
    cache.put(b, Outcome("2"))
    assert cache.get(a) is not None  # a is now the most recent
    cache.put(c, Outcome("3"))
    assert cache.get(b) is None and cache.get(a) is not None and cache.get(c) is not None
    cache.check_invariants()


# ---------------------------------------------------------------- compiler


@pytest.mark.parametrize("kind, value, fragment", [
    ("json_schema", '{"type": "foo"}', 'Unsupported type "foo"'),
    ("json_schema", "{not json", "not valid JSON"),
    ("regex", "a(b", "parenthesis is not closed"),
    ("ebnf", "root ::= foo", 'Rule "foo" is not defined'),
    ("structural_tag", '{"type": "x"}', "structural tag"),
])
def test_compile_errors_name_the_field(compiler, kind, value, fragment) -> None:
    with pytest.raises(GrammarError) as err:
        compiler.compile(GrammarSpec(kind, value, "the.field"))
    assert str(err.value).startswith("invalid value for 'the.field': ") and fragment in str(err.value)
    assert ".cc:" not in str(err.value)  # the compiler's source location is not the client's business


def test_compiled_grammar_round_trips_through_the_wire(compiler) -> None:
    spec = GrammarSpec("regex", "(ab)+", "p")
    spec.compiled = compiler.serialize(compiler.compile(spec))
    back = decode(encode(SamplingParams(grammar=spec))).grammar
    assert back == spec
    assert compiler.deserialize(back.compiled) is not None


def test_check_request_refuses_what_would_mask_every_token() -> None:
    spec = GrammarSpec("regex", "a", "p")
    assert check_request(spec, SamplingParams()) is None
    assert "ignore_eos" in check_request(spec, SamplingParams(ignore_eos=True))
    assert "min_tokens" in check_request(spec, SamplingParams(min_new_tokens=3))
    assert "unknown grammar kind" in check_request(GrammarSpec("yaml", "a"), SamplingParams())


# ---------------------------------------------------------------- worker matchers and masks


def token_id(tok, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def rows_for(tok, compiler, slots_specs: dict[int, str], max_slots: int = 4) -> GrammarRows:
    rows = GrammarRows(lambda: compiler.info, VOCAB, torch.device("cpu"), max_slots)
    for slot, regex in slots_specs.items():
        spec = GrammarSpec("regex", regex, "p")
        spec.compiled = compiler.serialize(compiler.compile(spec))
        rows.add(slot, spec, [])
    return rows


def fixed_read(tokens: list[int], bad: list[int] | None = None):
    return lambda: (np.asarray(tokens), np.asarray(bad or [0] * len(tokens)))


def test_mask_touches_only_constrained_rows_and_allows_only_the_grammar(tok, compiler) -> None:
    a = token_id(tok, "a")
    rows = rows_for(tok, compiler, {1: "a"})
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    deferred = rows.mask(logits, [0, 1, 3])  # slot 1 is row 1
    assert deferred is not None and [(r, s) for r, s, _ in deferred.rows] == [(1, 1)]
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert a in allowed and EOS not in allowed  # "a" must come before the output may end
    assert all(tok.decode([t]) in ("a",) or t == a for t in allowed)
    assert rows.mask(torch.randn(2, VOCAB), [0, 3]) is None  # no constrained row: nothing to do


def test_matcher_follows_tokens_only_once_and_ends_with_eos(tok, compiler) -> None:
    a = token_id(tok, "a")
    rows = rows_for(tok, compiler, {0: "a"})
    step1 = rows.mask(torch.randn(1, VOCAB), [0])
    step1.read = fixed_read([a])
    rows.expect(step1)
    logits = torch.randn(1, VOCAB)
    step2 = rows.mask(logits, [0])  # the next step's mask first takes step 1's token (the pipelined case)
    assert step1.done and torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]
    rows.resolve(step1)  # finish() of step 1 after the next launch: nothing happens twice
    step2.read = fixed_read([EOS])
    rows.expect(step2)
    rows.resolve(step2)
    logits = torch.randn(1, VOCAB)
    before = logits.clone()
    step3 = rows.mask(logits, [0])  # a step planned before the scheduler saw EOS: left alone
    assert torch.equal(logits, before) and step3.rows == []


def test_refused_token_marks_the_slot_and_bad_rows_are_skipped(tok, compiler) -> None:
    a, b = token_id(tok, "a"), token_id(tok, "b")
    rows = rows_for(tok, compiler, {0: "a", 1: "a"})
    step = rows.mask(torch.randn(2, VOCAB), [0, 1])
    step.read = fixed_read([b, b], bad=[0, 1])  # row 1 was a NaN row: its token means nothing
    rows.expect(step)
    rows.resolve(step)
    assert step.rejected == [0]
    logits = torch.randn(2, VOCAB)
    rows.mask(logits, [0, 1])
    assert a in torch.isfinite(logits[1]).nonzero().flatten().tolist()  # slot 1 still expects "a"


def test_preempted_sequence_replays_its_output(tok, compiler) -> None:
    a = token_id(tok, "a")
    spec = GrammarSpec("regex", "aa", "p")
    spec.compiled = compiler.serialize(compiler.compile(spec))
    rows = GrammarRows(lambda: compiler.info, VOCAB, torch.device("cpu"), 2)
    rows.add(0, spec, [a, a])  # re-registered after a preemption with two tokens out
    logits = torch.randn(1, VOCAB)
    rows.mask(logits, [0])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]
    with pytest.raises(ValueError, match="does not match its grammar"):
        rows.add(1, spec, [a, a, a])
    rows.remove(0)
    assert 0 not in rows and rows.mask(torch.randn(1, VOCAB), [0]) is None


@pytest.mark.parametrize("threads", [1, 2])
def test_batched_fill_masks_as_the_row_by_row_fill(tok, compiler, threads) -> None:
    a, b = token_id(tok, "a"), token_id(tok, "b")
    specs = {slot: ["a+", "b", "(ab)*", "[ab]{2}", "a|b"][slot % 5] for slot in range(8)}
    single = rows_for(tok, compiler, specs, max_slots=8)
    single.threads, single._batch = 1, None
    batched = GrammarRows(lambda: compiler.info, VOCAB, torch.device("cpu"), 8, threads=threads)
    for slot, regex in specs.items():
        spec = GrammarSpec("regex", regex, "p")
        spec.compiled = compiler.serialize(compiler.compile(spec))
        batched.add(slot, spec, [])
    slots = [7, 0, 3, 5, 1, 6, 2, 4]  # row i samples slot slots[i]
    steps = [[a, b, a, a, b, a, b, a], [a, EOS, b, b, EOS, a, EOS, b], [a, EOS, a, EOS, EOS, a, EOS, a]]
    deferred = []
    for tokens in steps:  # by slot; pipelined: each mask first takes the previous step's tokens
        logits = torch.randn(len(slots), VOCAB)
        outs = []
        for rows in (single, batched):
            masked = logits.clone()
            step = rows.mask(masked, slots)
            step.read = fixed_read([tokens[s] for s in slots])
            rows.expect(step)
            deferred.append(step)
            outs.append(masked)
        assert torch.equal(outs[0], outs[1]) and not torch.isfinite(outs[1]).all()
    assert all(step.rejected == [] for step in deferred)
    assert (batched._batch is not None) == (threads > 1)


def test_host_and_wait_time_are_counted_apart(tok, compiler) -> None:
    a = token_id(tok, "a")
    rows = rows_for(tok, compiler, {0: "a+"})
    step1 = rows.mask(torch.randn(1, VOCAB), [0])
    assert rows.host_s > 0 and rows.wait_s == 0

    def slow_read():
        time.sleep(0.05)
        return np.asarray([a]), np.asarray([0])

    step1.read = slow_read
    rows.expect(step1)
    host = rows.host_s
    rows.mask(torch.randn(1, VOCAB), [0])  # waits for step 1's token
    assert rows.wait_s >= 0.05 and rows.host_s - host < 0.05


# ---------------------------------------------------------------- the tokenizer's compile service


class SlowCompiler:
    """A stand-in for app.grammar.compiler.Compiler that takes `delay` seconds a compile."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.calls = 0

    def compile(self, spec: GrammarSpec) -> str:
        self.calls += 1
        time.sleep(self.delay)
        if spec.value == "bad":
            raise GrammarError(f"invalid value for '{spec.param}': bad")
        return spec.value

    def serialize(self, compiled: str) -> str:
        return f"compiled:{compiled}"


def wait_poll(service: GrammarService, count: int, timeout: float = 5.0) -> list:
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        out += service.poll()
        time.sleep(0.005)
    return out


def test_service_compiles_once_for_many_waiters_then_answers_from_cache() -> None:
    fake = SlowCompiler(0.05)
    service = GrammarService(lambda: fake, cache_size=4, timeout_s=10)
    spec = GrammarSpec("regex", "x", "p")
    assert service.lookup(spec) is None
    service.hold("r1", spec, "one")
    service.hold("r2", GrammarSpec("regex", "x", "q"), "two")
    done = wait_poll(service, 2)
    assert sorted(h.payload for h, _ in done) == ["one", "two"]
    assert all(o.compiled == "compiled:x" for _, o in done) and fake.calls == 1
    assert service.lookup(spec).compiled == "compiled:x" and not service.pending
    service.cache.check_invariants()
    service.close()


def test_service_errors_and_timeouts_fail_only_their_request() -> None:
    fake = SlowCompiler(0.3)
    service = GrammarService(lambda: fake, cache_size=4, timeout_s=0.1)
    service.hold("slow", GrammarSpec("regex", "slow", "p"), None)
    [(held, outcome)] = wait_poll(service, 1)
    assert held.rid == "slow" and "took longer than 0.1 s" in outcome.error
    fake.delay = 0
    service._timeout_s = 10
    service.hold("bad", GrammarSpec("regex", "bad", "p"), None)
    service.hold("good", GrammarSpec("regex", "good", "p"), None)
    results = {h.rid: o for h, o in wait_poll(service, 2)}
    assert results["bad"].error == "invalid value for 'p': bad" and results["good"].compiled == "compiled:good"
    time.sleep(0.3)
    service.poll()
    assert service.lookup(GrammarSpec("regex", "slow", "p")).compiled == "compiled:slow"  # cached after all
    service.close()


def test_tokenizer_holds_a_request_until_its_grammar_compiles(tok) -> None:
    core = TokenizerCore(tok)
    core.handle(EngineReady(engine=EngineInfo(max_model_len=64, vocab_size=VOCAB, eos_token_ids=[EOS])))
    spec = GrammarSpec("regex", "(ab)+", "sampling_params.regex")
    req = GenerateRequest(rid="r1", sampling=SamplingParams(grammar=spec), text="Hello")
    assert core.handle(req) == [] and core.num_live_requests == 1
    deadline = time.monotonic() + 60
    out: list = []
    while not out and time.monotonic() < deadline:
        out = core.poll_grammars()
        time.sleep(0.01)
    [sent] = out
    assert sent.dest == SCHEDULER and isinstance(sent.msg, TokenizedRequest) and sent.msg.sampling.grammar.compiled
    again = GenerateRequest(rid="r2", sampling=SamplingParams(grammar=GrammarSpec("regex", "(ab)+", "x")), text="Hi")
    [cached] = core.handle(again)  # cached: sent on at once
    assert cached.msg.sampling.grammar.compiled == sent.msg.sampling.grammar.compiled
    bad = GenerateRequest(rid="r3", sampling=SamplingParams(grammar=GrammarSpec("regex", "a(", "f")), text="Hi")
    assert core.handle(bad) == []
    abort = core.handle(AbortRequest(rid="r3"))  # aborted while compiling: ends at once, no compile answer
    [delta] = abort[0].msg.deltas
    assert delta.rid == "r3" and delta.finish_reason == "abort" and core.poll_grammars() == []
    errors = core.handle(GenerateRequest(rid="r4", sampling=SamplingParams(grammar=spec, ignore_eos=True), text="x"))
    assert isinstance(errors[0].msg, TextDeltas) and errors[0].msg.deltas[0].error_code == 400
    core.grammars.close()


# ---------------------------------------------------------------- HTTP fields


def test_openai_fields_map_to_one_grammar() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = openai_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}, {}, None)
    assert (spec.kind, json.loads(spec.value), spec.param) == ("json_schema", schema, "response_format.json_schema.schema")
    assert openai_grammar({"type": "text"}, {}, None) is None
    assert openai_grammar({"type": "json_object"}, {}, None).kind == "json_object"
    assert openai_grammar(None, {"guided_regex": "a+"}, None).kind == "regex"
    choice = openai_grammar(None, {"guided_choice": ["yes", 'say "no"']}, None)
    assert choice.kind == "ebnf" and choice.value == 'root ::= "yes" | "say \\"no\\""'
    assert openai_grammar(None, {}, {"json": json.dumps(schema)}).param == "structured_outputs.json"
    assert native_grammar({"json_schema": json.dumps(schema), "regex": None}, "sampling_params").kind == "json_schema"


@pytest.mark.parametrize("response_format, guided, structured, fragment", [
    ({"type": "xml"}, {}, None, "response_format.type"),
    ({"type": "json_schema"}, {}, None, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, {}, None, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, {}, None, "must be an object"),
    ({"type": "json_object"}, {"guided_regex": "a"}, None, "cannot be combined"),
    (None, {"guided_choice": []}, None, "guided_choice"),
    (None, {}, {"regex": "a", "grammar": "root ::= \"a\""}, "cannot be combined"),
    (None, {}, {"disable_any_whitespace": True}, "structured_outputs.disable_any_whitespace"),
])
def test_bad_openai_fields_are_400s_naming_the_field(response_format, guided, structured, fragment) -> None:
    with pytest.raises(APIError) as err:
        openai_grammar(response_format, guided, structured)
    assert err.value.status == 400 and fragment in str(err.value)
