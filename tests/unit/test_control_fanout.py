"""Combining the data-parallel replicas' control replies into one (app/tokenizer/control_fanout.py)."""

from __future__ import annotations

from app import protocol as p
from app.protocol import ControlReply, ControlRequest
from app.tokenizer.control_fanout import ControlFanOut, combine


def loads(dp_rank: int, num_running: int) -> p.Loads:
    return p.Loads(dp_rank, num_running, 0, 0.0, 0, 0, 8, 0, False, False, 0)


def answer(fan: ControlFanOut, req: ControlRequest, replies: dict[int, ControlReply]) -> ControlReply | None:
    """Send req through fan, answer each replica's copy (in the given order) with the reply's fields."""
    copies = dict(fan.split(req))
    out = None
    for replica, reply in replies.items():
        out = fan.collect(ControlReply(copies[replica].req_id, reply.success, reply.message, reply.result))
    return out


def test_one_replica_passes_the_reply_through_unchanged() -> None:
    fan = ControlFanOut(1)
    req = ControlRequest("r", p.UpdateWeightsFromDisk("/m"))
    assert fan.split(req) == [(0, req)]
    reply = ControlReply("r", False, "weights not updated: bad shape", p.WeightIdentity(model_path="/m"))
    assert fan.collect(reply) == reply
    assert fan.num_pending == 0


def test_the_combined_reply_waits_for_every_replica_in_any_order() -> None:
    fan = ControlFanOut(3)
    req = ControlRequest("r", p.PauseGeneration("abort"))
    copies = fan.split(req)
    assert [(d, c.op) for d, c in copies] == [(d, p.PauseGeneration("abort")) for d in range(3)]
    ids = [c.req_id for _, c in copies]
    assert len(set(ids)) == 3 and "r" not in ids
    assert fan.collect(ControlReply(ids[2], True, "Paused generation.")) is None
    assert fan.collect(ControlReply(ids[0], True, "Paused generation.")) is None
    done = fan.collect(ControlReply(ids[1], True, "Paused generation."))
    assert done == ControlReply("r", True, "Paused generation.")
    assert fan.num_pending == 0


def test_a_failure_names_the_failing_replica_and_the_ones_that_succeeded() -> None:
    fan = ControlFanOut(3)
    req = ControlRequest("r", p.UpdateWeightsFromTensor(b"", weight_version="v2"))
    ok = ControlReply("", True, "Updated 4 tensors. Weight version updated to v2.", p.WeightIdentity("v2"))
    out = answer(fan, req, {0: ok, 1: ControlReply("", False, "weights not updated: shape"), 2: ok})
    assert out is not None and not out.success
    assert out.message == "replica 1 failed: weights not updated: shape; succeeded on replicas 0, 2"
    assert out.result is None  # not agreed: http applies no version


def test_success_keeps_each_agreed_field_of_the_weight_identity() -> None:
    replies = [ControlReply("a", True, "done", p.WeightIdentity("v3", "/new")),
               ControlReply("b", True, "done", p.WeightIdentity("v3", "/other"))]
    out = combine("r", p.UpdateWeightsFromDisk("/new"), replies)
    assert out == ControlReply("r", True, "done", p.WeightIdentity("v3", None))


def test_get_loads_gives_one_entry_per_replica_in_replica_order() -> None:
    fan = ControlFanOut(2)
    out = answer(fan, ControlRequest("r", p.GetLoads()), {1: ControlReply("", True, "", loads(1, 5)),
                                                          0: ControlReply("", True, "", loads(0, 2))})
    assert out == ControlReply("r", True, "", p.AllLoads([loads(0, 2), loads(1, 5)]))
    one = ControlFanOut(1)
    assert answer(one, ControlRequest("s", p.GetLoads()), {0: ControlReply("", True, "", loads(0, 1))}) == \
        ControlReply("s", True, "", p.AllLoads([loads(0, 1)]))


def test_unknown_and_duplicate_ids() -> None:
    fan = ControlFanOut(2)
    assert fan.collect(ControlReply("stray", True)) is None
    req = ControlRequest("r", p.FlushCache())
    fan.split(req)
    refused = fan.refusal(req)
    assert refused is not None and not refused.success and "already in use" in refused.message
    assert fan.refusal(ControlRequest("s", p.FlushCache())) is None


def test_trainer_group_needs_one_replica() -> None:
    req = ControlRequest("r", p.InitWeightsUpdateGroup("h", 1, rank_offset=1, world_size=2))
    assert ControlFanOut(1).refusal(req) is None
    refused = ControlFanOut(2).refusal(req)
    assert refused is not None and not refused.success and "--data-parallel-size 1" in refused.message
