"""The start-up messages (app/protocol.py): the worker's figures travel typed, from the worker to the
supervisor and on to http, and no *Ready message carries a dict of figures read by string."""

from __future__ import annotations

import dataclasses
import typing

from app import protocol as p

FIGURES = p.StartupFigures(
    weights_gb=0.27, kv_pool_tokens=4096, max_concurrency=8.0, load_seconds=1.25, dtype="bfloat16",
    device="cuda:0", architecture="LlamaForCausalLM", attention_backend="fa3", decode_kernel="fa3",
    cuda_graph_sizes=[1, 2, 4], piecewise_graph_sizes=[256], pdl=True, cuda_graph_gb=0.01,
    quantization="fp8", kv_cache_dtype="auto", startup_phases={"weights": 0.5, "warmup": 0.1},
)
ENGINE = p.EngineInfo(max_model_len=512, vocab_size=100, eos_token_ids=[2], startup_seconds=3.0)


def test_the_ready_messages_round_trip_with_their_figures() -> None:
    for msg in (
        p.WorkerReady(0, 16, 16, 512, 100, [2], FIGURES),
        p.ProcessReady("worker0", 7, FIGURES, ENGINE),
        p.ProcessReady("http", 8, port=8000),
        p.EngineReady(FIGURES, ENGINE),
        p.EngineReady(),  # a worker node's health-only http
    ):
        back = p.decode(p.encode(msg))
        assert back == msg and type(back) is type(msg)
    assert type(p.decode(p.encode(p.EngineReady(FIGURES))).info) is p.StartupFigures


def test_no_ready_message_carries_an_untyped_dict() -> None:
    for cls in (p.WorkerReady, p.ProcessReady, p.EngineReady, p.StartupFigures, p.EngineInfo):
        for name, hint in typing.get_type_hints(cls).items():
            assert "Any" not in str(hint), f"{cls.__name__}.{name}: {hint}"
    assert {f.name for f in dataclasses.fields(p.StartupFigures)}.isdisjoint(
        f.name for f in dataclasses.fields(p.EngineInfo))  # /get_server_info merges the two flat
