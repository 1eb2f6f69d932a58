"""Combining the data-parallel replicas' control replies into one (app/tokenizer/control_fanout.py)."""

from __future__ import annotations

from app.protocol import ControlReply, ControlRequest
from app.tokenizer.control_fanout import ControlFanOut, combine


def answer(fan: ControlFanOut, req: ControlRequest, replies: dict[int, ControlReply]) -> ControlReply | None:
    """Send req through fan, answer each replica's copy (in the given order) with the reply's fields."""
    copies = dict(fan.split(req))
    out = None
    for replica, reply in replies.items():
        out = fan.collect(ControlReply(copies[replica].req_id, reply.success, reply.message, reply.data))
    return out


def test_one_replica_passes_the_reply_through_unchanged() -> None:
    fan = ControlFanOut(1)
    req = ControlRequest("r", "update_weights_from_disk", {"model_path": "/m"})
    assert fan.split(req) == [(0, req)]
    reply = ControlReply("r", False, "weights not updated: bad shape", {"x": 1})
    assert fan.collect(reply) == reply
    assert fan.num_pending == 0


def test_the_combined_reply_waits_for_every_replica_in_any_order() -> None:
    fan = ControlFanOut(3)
    req = ControlRequest("r", "pause_generation", {"mode": "abort"})
    copies = fan.split(req)
    assert [(d, c.kind, c.args) for d, c in copies] == [(d, "pause_generation", {"mode": "abort"}) for d in range(3)]
    ids = [c.req_id for _, c in copies]
    assert len(set(ids)) == 3 and "r" not in ids
    assert fan.collect(ControlReply(ids[2], True, "Paused generation.")) is None
    assert fan.collect(ControlReply(ids[0], True, "Paused generation.")) is None
    done = fan.collect(ControlReply(ids[1], True, "Paused generation."))
    assert done == ControlReply("r", True, "Paused generation.", {})
    assert fan.num_pending == 0


def test_a_failure_names_the_failing_replica_and_the_ones_that_succeeded() -> None:
    fan = ControlFanOut(3)
    req = ControlRequest("r", "update_weights_from_tensor", {"weight_version": "v2"})
    ok = ControlReply("", True, "Updated 4 tensors. Weight version updated to v2.", {"weight_version": "v2"})
    out = answer(fan, req, {0: ok, 1: ControlReply("", False, "weights not updated: shape"), 2: ok})
    assert out is not None and not out.success
    assert out.message == "replica 1 failed: weights not updated: shape; succeeded on replicas 0, 2"
    assert out.data == {"weight_version": ["v2", None, "v2"]}  # not agreed: http applies no version


def test_success_keeps_agreed_data_and_lists_the_rest() -> None:
    replies = [ControlReply("a", True, "done", {"weight_version": "v3", "model_path": "/new", "n": 1}),
               ControlReply("b", True, "done", {"weight_version": "v3", "model_path": "/new", "n": 2})]
    out = combine("r", "update_weights_from_disk", replies)
    assert out == ControlReply("r", True, "done", {"weight_version": "v3", "model_path": "/new", "n": [1, 2]})


def test_get_loads_gives_one_entry_per_replica_with_its_dp_rank() -> None:
    fan = ControlFanOut(2)
    out = answer(fan, ControlRequest("r", "get_loads"), {1: ControlReply("", True, "", {"num_running": 5}),
                                                         0: ControlReply("", True, "", {"num_running": 2})})
    assert out == ControlReply("r", True, "", {"loads": [{"dp_rank": 0, "num_running": 2},
                                                         {"dp_rank": 1, "num_running": 5}]})


def test_unknown_and_duplicate_ids() -> None:
    fan = ControlFanOut(2)
    assert fan.collect(ControlReply("stray", True)) is None
    req = ControlRequest("r", "flush_cache")
    fan.split(req)
    refused = fan.refusal(req)
    assert refused is not None and not refused.success and "already in use" in refused.message
    assert fan.refusal(ControlRequest("s", "flush_cache")) is None


def test_trainer_group_needs_one_replica() -> None:
    req = ControlRequest("r", "init_weights_update_group", {"rank_offset": 1, "world_size": 2})
    assert ControlFanOut(1).refusal(req) is None
    refused = ControlFanOut(2).refusal(req)
    assert refused is not None and not refused.success and "--data-parallel-size 1" in refused.message
