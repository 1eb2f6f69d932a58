"""The typed control messages (app/protocol.py): every operation and result crosses the wire intact, and the
HTTP bodies that become operations declare the same fields."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from app import protocol as p
from app.http import rl_control

OPS = typing.get_args(p.ControlOp)
RESULTS = typing.get_args(p.ControlResult)
LOADS = p.Loads(1, 2, 3, 0.5, 4, 5, 64, 6, True, False, 7)
EXAMPLES = [
    p.FlushCache(), p.GetLoads(), p.PauseGeneration("retract"), p.ContinueGeneration(),
    p.UpdateWeightsFromDisk("/ckpt", "safetensors", "v2"),
    p.InitWeightsUpdateGroup("10.0.0.1", 29500, 1, 2, "g", "gloo"), p.DestroyWeightsUpdateGroup("g"),
    p.UpdateWeightsFromDistributed(["a", "b"], ["bfloat16", "float32"], [[2, 3], [4]], "g", False, "v3"),
    p.UpdateWeightsFromTensor(b"\x00\xffsafetensors", True, None), p.StartWeightUpdate(), p.FinishWeightUpdate("v4"),
    p.Tokenize(messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={"enable_thinking": False},
               tools=[{"type": "function", "function": {"name": "f"}}], add_special_tokens=False,
               return_token_strs=True),
    p.Detokenize([[1, 2], [3]], True),
]
RESULT_EXAMPLES = [LOADS, p.AllLoads([LOADS, dataclasses.replace(LOADS, dp_rank=2)]), p.WeightIdentity("v2", "/m"),
                   p.Tokenized([[1, 2]], [["a", "b"]]), p.Detokenized(["ab"])]


def test_every_operation_and_result_has_an_example_and_a_wire_tag() -> None:
    assert {type(op) for op in EXAMPLES} == set(OPS)
    assert {type(r) for r in RESULT_EXAMPLES} == set(RESULTS)
    assert set(OPS) | set(RESULTS) <= set(p.MESSAGE_TYPES)
    kinds = [op.KIND for op in OPS]
    assert len(set(kinds)) == len(kinds) and all(k and k.islower() for k in kinds)


@pytest.mark.parametrize("op", EXAMPLES, ids=lambda op: op.KIND)
def test_a_request_round_trips(op: p.ControlOp) -> None:
    msg = p.ControlRequest("id", op)
    back = p.decode(p.encode(msg))
    assert back == msg and type(back.op) is type(op) and back.kind == op.KIND


@pytest.mark.parametrize("result", [None, *RESULT_EXAMPLES], ids=lambda r: type(r).__name__)
def test_a_reply_round_trips(result: p.ControlResult | None) -> None:
    msg = p.ControlReply("id", True, "done", result)
    assert p.decode(p.encode(msg)) == msg


BODIES = [
    (rl_control.DiskBody, p.UpdateWeightsFromDisk),
    (rl_control.InitGroupBody, p.InitWeightsUpdateGroup),
    (rl_control.GroupBody, p.DestroyWeightsUpdateGroup),
    (rl_control.DistributedBody, p.UpdateWeightsFromDistributed),
    (rl_control.FinishBody, p.FinishWeightUpdate),
    (rl_control.PauseBody, p.PauseGeneration),
]


@pytest.mark.parametrize(("body", "op"), BODIES, ids=lambda x: x.__name__)
def test_a_route_body_declares_its_operations_fields_with_its_defaults(body, op) -> None:
    fields = {f.name: f for f in dataclasses.fields(op)}
    assert list(body.model_fields) == list(fields)
    for name, info in body.model_fields.items():
        if not info.is_required():
            assert info.default == fields[name].default, name


def test_a_request_without_an_operation_is_named_by_its_type() -> None:
    """Receivers refuse it by that name ("unknown control operation 'Shutdown'") instead of failing."""
    assert p.ControlRequest("id", p.Shutdown()).kind == "Shutdown"  # type: ignore[arg-type]
