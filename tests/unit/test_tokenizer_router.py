"""Data-parallel routing in the tokenizer: the Router alone, then TokenizerCore over two replicas (no sockets)."""

from __future__ import annotations

import pytest

from app.protocol import (
    AbortRequest,
    AllLoads,
    ControlReply,
    ControlRequest,
    EngineInfo,
    EngineReady,
    FinishRequest,
    FlushCache,
    GenerateRequest,
    GetLoads,
    InitWeightsUpdateGroup,
    Loads,
    SamplingParams,
    TokenDelta,
    TokenDeltas,
    TokenizedRequest,
)
from app.tokenizer.core import HTTP, SCHEDULER, TokenizerCore
from app.tokenizer.router import Router

# ---------------------------------------------------------------- Router


def test_shortest_queue_picks_the_least_loaded_and_ties_go_low() -> None:
    r = Router(3, "shortest_queue")
    assert [r.route(f"a{i}", [i]) for i in range(3)] == [0, 1, 2]
    assert r.route("a3", [3]) == 0  # all tied at 1
    assert r.loads == [2, 1, 1]
    r.release("a1")
    r.release("a2")
    assert r.route("a4", [4]) == 1  # 1 and 2 tied at 0: the lower index
    r.release("a0")
    r.release("a3")
    assert r.loads == [0, 1, 0]
    assert r.route("a5", [5]) == 0


def test_round_robin_goes_in_turn_whatever_the_load() -> None:
    r = Router(3, "round_robin")
    assert [r.route(f"a{i}", [i]) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    for i in range(6):
        r.release(f"a{i}")
    assert r.loads == [1, 0, 0]
    assert r.route("b", [0]) == 1


def test_replica_of_and_release_track_live_requests() -> None:
    r = Router(2)
    r.route("x", [1])
    r.route("y", [2])
    assert (r.replica_of("x"), r.replica_of("y"), r.replica_of("z")) == (0, 1, None)
    r.release("x")
    r.release("x")  # twice, and unknown rids, are no-ops
    r.release("nope")
    assert r.replica_of("x") is None and r.loads == [0, 1]
    with pytest.raises(ValueError, match="already routed"):
        r.route("y", [2])


def test_fan_out_siblings_with_the_same_prompt_share_a_replica() -> None:
    r = Router(2, "round_robin")
    prompt = [5, 6, 7]
    assert {r.route(f"cmpl-1-{i}", prompt) for i in range(4)} == {0}  # n = 4: one replica, the turn kept
    assert r.route("other", [1]) == 1
    assert r.route("cmpl-1-9", [9, 9]) == 0  # a different prompt (batch fan-out): routed on its own
    assert r.route("cmpl-2-0", prompt) == 1  # another request's samples: their own group
    assert r.loads == [5, 2]
    for i in range(4):
        r.release(f"cmpl-1-{i}")
    assert r.route("x", [0]) == 0
    assert r.route("cmpl-1-5", prompt) == 1  # the group ended with its last live member: routed afresh


def test_shortest_queue_groups_siblings_too() -> None:
    r = Router(2)
    assert [r.route(f"c-{i}", [1, 2]) for i in range(3)] == [0, 0, 0]
    assert r.route("d", [1, 2]) == 1  # not a sibling rid: the least loaded


def test_one_replica_routes_everything_to_zero() -> None:
    r = Router()
    assert {r.route(f"q-{i}", [i % 2]) for i in range(5)} == {0}
    assert r.loads == [5]


def test_bad_router_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="minimum_cache_usage"):
        Router(2, "minimum_cache_usage")
    with pytest.raises(ValueError, match="at least one replica"):
        Router(0)


# ---------------------------------------------------------------- TokenizerCore over two replicas

MAX_MODEL_LEN = 64


def two_replicas(tok, method: str = "shortest_queue") -> TokenizerCore:
    core = TokenizerCore(tok, router=Router(2, method))
    core.handle(EngineReady(engine=EngineInfo(max_model_len=MAX_MODEL_LEN, vocab_size=512, eos_token_ids=[2])))
    return core


def submit(core: TokenizerCore, rid: str, **sampling) -> int:
    out = core.handle(GenerateRequest(rid=rid, sampling=SamplingParams(**sampling), input_ids=[10, 11, 12]))
    [o] = out
    assert o.dest == SCHEDULER and isinstance(o.msg, TokenizedRequest) and o.msg.rid == rid
    return o.replica


def finish(core: TokenizerCore, rid: str, token: int = 40):
    return core.handle(TokenDeltas([TokenDelta(rid=rid, token_ids=[token], finish_reason="length",
                                               prompt_tokens=3, completion_tokens=1)]))


def test_requests_spread_and_follow_ups_reach_their_replica(tok) -> None:
    core = two_replicas(tok)
    assert [submit(core, r) for r in ("a", "b", "c")] == [0, 1, 0]
    abort = AbortRequest(rid="b", reason="gone")
    assert [(o.dest, o.replica, o.msg) for o in core.handle(abort)] == [(SCHEDULER, 1, abort)]
    finish(core, "b")  # the terminal delta frees b's place
    assert core.router.loads == [2, 0]
    assert core.handle(AbortRequest(rid="b")) == []  # over already: no replica to tell
    assert submit(core, "d") == 1


def test_abort_all_goes_to_every_replica(tok) -> None:
    core = two_replicas(tok)
    msg = AbortRequest(abort_all=True, reason="all")
    assert [(o.dest, o.replica, o.msg) for o in core.handle(msg)] == [(SCHEDULER, 0, msg), (SCHEDULER, 1, msg)]


def test_stop_string_finish_goes_to_the_holder_then_frees_the_place(tok) -> None:
    core = two_replicas(tok)
    submit(core, "a")
    assert submit(core, "b", stop=["lazy"]) == 1
    ids = tok.encode(" the lazy dog")
    out = core.handle(TokenDeltas([TokenDelta(rid="b", token_ids=ids, prompt_tokens=3, completion_tokens=len(ids))]))
    finishes = [(o.replica, o.msg) for o in out if o.dest == SCHEDULER]
    assert finishes == [(1, FinishRequest("b"))]
    assert [d.finish_reason for o in out if o.dest == HTTP for d in o.msg.deltas] == ["stop"]
    assert core.router.loads == [1, 0]


def test_a_failed_detokenization_aborts_on_the_holder(tok, monkeypatch) -> None:
    core = two_replicas(tok, "round_robin")
    submit(core, "a")
    submit(core, "b")
    monkeypatch.setattr("app.tokenizer.output.RequestOutput.on_delta",
                        lambda self, delta: (_ for _ in ()).throw(RuntimeError("boom")))
    out = core.handle(TokenDeltas([TokenDelta(rid="b", token_ids=[40], prompt_tokens=3, completion_tokens=1)]))
    aborts = [(o.replica, o.msg.rid) for o in out if o.dest == SCHEDULER and isinstance(o.msg, AbortRequest)]
    assert aborts == [(1, "b")]
    assert core.router.loads == [1, 0]


def test_control_fans_out_and_one_combined_reply_reaches_http(tok) -> None:
    core = two_replicas(tok)
    out = core.handle(ControlRequest("c1", FlushCache()))
    assert [(o.dest, o.replica, o.msg.kind) for o in out] == [(SCHEDULER, 0, "flush_cache"), (SCHEDULER, 1, "flush_cache")]
    sub0, sub1 = (o.msg.req_id for o in out)
    assert len({sub0, sub1, "c1"}) == 3  # each replica answers under its own id
    assert core.handle(ControlReply(sub1, True, "Cache flushed (0 cached blocks dropped).")) == []
    [reply] = core.handle(ControlReply(sub0, True, "Cache flushed (2 cached blocks dropped)."))
    assert reply.dest == HTTP and reply.msg.req_id == "c1" and reply.msg.success
    assert reply.msg.message == ("replica 0: Cache flushed (2 cached blocks dropped).; "
                                 "replica 1: Cache flushed (0 cached blocks dropped).")
    assert core.handle(ControlReply(sub0, True)) == []  # a late duplicate is dropped


def test_get_loads_with_one_replica_is_a_list_of_one(tok) -> None:
    core = TokenizerCore(tok)
    [o] = core.handle(ControlRequest("g", GetLoads()))
    assert (o.replica, o.msg) == (0, ControlRequest("g", GetLoads()))  # one replica: the request unchanged
    loads = Loads(0, 3, 0, 0.25, 2, 1, 8, 0, False, False, 0)
    [reply] = core.handle(ControlReply("g", True, "", loads))
    assert reply.msg == ControlReply("g", True, "", AllLoads([loads]))


def test_init_weights_update_group_is_refused_with_several_replicas(tok) -> None:
    [o] = two_replicas(tok).handle(ControlRequest("w", InitWeightsUpdateGroup("h", 1, rank_offset=1, world_size=2)))
    assert o.dest == HTTP and not o.msg.success and "--data-parallel-size 1" in o.msg.message
