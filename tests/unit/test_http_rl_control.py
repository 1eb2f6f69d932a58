"""The RL control routes in the HTTP process: bodies, the control messages they send, SGLang-style answers,
and the weight version living in one place that every route (and every response) reads."""

from __future__ import annotations

import base64

import pytest
import torch
from safetensors.torch import save

from app import protocol as p
from app.protocol import ControlReply, ControlRequest
from tests.unit.test_http_fakes import MODEL_PATH, FakeEngine, asgi_client, assert_error

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def engine_answering(report_path: bool = False) -> FakeEngine:
    """A fake engine whose replies carry the weight identity the scheduler would report: the operation's
    version, and (report_path) a disk load's model path; model_path "/bad" is refused."""
    engine = FakeEngine()

    def reply(msg: ControlRequest) -> ControlReply:
        op = msg.op
        path = op.model_path if isinstance(op, p.UpdateWeightsFromDisk) else None
        identity = p.WeightIdentity(getattr(op, "weight_version", None), path if report_path else None)
        return ControlReply(msg.req_id, path != "/bad", f"did {msg.kind}", identity)

    engine.control_reply = reply
    return engine


async def test_disk_update_changes_version_and_model_path_everywhere() -> None:
    engine = engine_answering(report_path=True)
    async with asgi_client(engine, weight_version="v1") as c:
        ok = await c.post("/update_weights_from_disk", json={"model_path": "/ckpt/2", "weight_version": "v2"})
        info = (await c.get("/model_info")).json()
        model_info = (await c.get("/get_model_info")).json()
        version = (await c.get("/get_weight_version")).json()
        gen = (await c.post("/generate", json={"text": "hi"})).json()
        failed = await c.post("/update_weights_from_disk", json={"model_path": "/bad", "weight_version": "v3"})
        after = (await c.get("/get_weight_version")).json()
    assert ok.status_code == 200 and ok.json() == {"success": True, "message": "did update_weights_from_disk"}
    assert info == {"model_path": "/ckpt/2", "weight_version": "v2"} and model_info["model_path"] == "/ckpt/2"
    assert version == {"weight_version": "v2"} and gen["meta_info"]["weight_version"] == "v2"
    assert failed.status_code == 400 and failed.json()["success"] is False
    assert after == {"weight_version": "v2"}  # a refused update changes nothing
    sent = engine.controls[0]
    assert sent.op == p.UpdateWeightsFromDisk("/ckpt/2", None, "v2")


async def test_an_update_without_a_version_keeps_it() -> None:
    engine = engine_answering()
    async with asgi_client(engine, weight_version="v1") as c:
        await c.post("/update_weights_from_disk", json={"model_path": "/ckpt/2"})
        assert (await c.get("/get_weight_version")).json() == {"weight_version": "v1"}
        assert (await c.get("/model_info")).json()["model_path"] == MODEL_PATH


async def test_distributed_and_group_bodies() -> None:
    engine = engine_answering()
    async with asgi_client(engine) as c:
        init = await c.post("/init_weights_update_group", json={
            "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2,
            "backend": "gloo"})
        upd = await c.post("/update_weights_from_distributed", json={
            "names": ["a", "b"], "dtypes": ["bfloat16", "float32"], "shapes": [[2, 3], [4]], "weight_version": "s1"})
        ragged = await c.post("/update_weights_from_distributed", json={
            "names": ["a"], "dtypes": ["bfloat16", "float32"], "shapes": [[2]]})
        bad_rank = await c.post("/init_weights_update_group", json={
            "master_address": "h", "master_port": 1, "rank_offset": 2, "world_size": 2})
        destroy = await c.post("/destroy_weights_update_group")  # SGLang clients may send no body
        version = (await c.get("/get_weight_version")).json()
    assert init.status_code == upd.status_code == destroy.status_code == 200
    ops = [m.op for m in engine.controls]
    assert ops[0] == p.InitWeightsUpdateGroup("10.0.0.1", 29500, 1, 2, "weight_update_group", "gloo")
    assert ops[1] == p.UpdateWeightsFromDistributed(["a", "b"], ["bfloat16", "float32"], [[2, 3], [4]],
                                                    "weight_update_group", True, "s1")
    assert ops[2] == p.DestroyWeightsUpdateGroup("weight_update_group")
    assert "same length" in assert_error(ragged, 400)["message"]
    assert "rank_offset" in assert_error(bad_rank, 400)["message"]
    assert version == {"weight_version": "s1"}


async def test_tensor_update_payload_is_base64_safetensors() -> None:
    engine = engine_answering()
    payload = save({"model.norm.weight": torch.ones(4)})
    async with asgi_client(engine) as c:
        ok = await c.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [base64.b64encode(payload).decode()], "flush_cache": False})
        not_b64 = await c.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["%%%"]})
        two_ranks = await c.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["", ""]})
    assert ok.status_code == 200
    (sent,) = engine.controls
    assert sent.op == p.UpdateWeightsFromTensor(payload, flush_cache=False, weight_version=None)
    assert assert_error(not_b64, 400)["param"] == "serialized_named_tensors[0]"
    assert_error(two_ranks, 400, "serialized_named_tensors")


async def test_chunked_update_routes_pause_and_continue() -> None:
    engine = engine_answering()
    async with asgi_client(engine) as c:
        for path, body in [("/start_weight_update", None), ("/finish_weight_update", {"weight_version": "z"}),
                           ("/pause_generation", {"mode": "abort"}), ("/pause_generation", None),
                           ("/continue_generation", None)]:
            r = await (c.post(path, json=body) if body is not None else c.post(path))
            assert r.status_code == 200, (path, r.text)
        bad_mode = await c.post("/pause_generation", json={"mode": "later"})
        extra = await c.post("/finish_weight_update", json={"weight_version": "z", "flush": True})
        version = (await c.get("/get_weight_version")).json()
    assert [m.op for m in engine.controls] == [
        p.StartWeightUpdate(), p.FinishWeightUpdate("z"), p.PauseGeneration("abort"), p.PauseGeneration("in_place"),
        p.ContinueGeneration()]
    assert_error(bad_mode, 400, "mode")
    assert_error(extra, 400, "flush")
    assert version == {"weight_version": "z"}


async def test_weight_routes_need_a_ready_engine() -> None:
    async with asgi_client(FakeEngine(ready=False)) as c:
        assert_error(await c.post("/update_weights_from_disk", json={"model_path": "/x"}), 503)
