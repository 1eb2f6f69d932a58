"""The supervisor's EngineReady (app/supervisor.py announce_ready): the worker leader's typed start-up
figures with the supervisor's own phases first, and EngineInfo completed from the tokenizer's part and
the settings, sent to the tokenizer."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from app import ipc
from app import protocol as p
from app.supervisor import Supervisor
from tests.support.settings import make_settings

WORKER = p.StartupFigures(weights_gb=0.5, kv_pool_tokens=4096, dtype="bfloat16",
                          startup_phases={"init": 0.25, "weights": 1.5, "warmup": 0.125})


@pytest.fixture
def sup() -> Iterator[Supervisor]:
    sup = Supervisor(make_settings(served_model_name="served", enable_metrics=True))
    try:
        yield sup
    finally:
        sup.close()


def test_engine_ready_carries_the_leaders_figures_and_every_phase(sup: Supervisor) -> None:
    tokenizer = ipc.bind_pull(sup.ctx, sup.endpoints.inbox("tokenizer"))
    leader = sup.topology.worker_name(0, 0)
    sup.ready_info = {leader: WORKER, "tokenizer": None, "scheduler0": None, "http": None}
    sup.ready_engine = {leader: p.EngineInfo(max_model_len=512, vocab_size=100, eos_token_ids=[2], num_blocks=1024),
                        "tokenizer": p.EngineInfo(max_token_chars=12)}
    sup.phase_seconds = {"download": 2.0}
    sup.announce_ready(time.time() - 5.0)
    assert tokenizer.poll(5000), "no EngineReady sent"
    msg = ipc.recv(tokenizer)
    assert isinstance(msg, p.EngineReady) and isinstance(msg.info, p.StartupFigures)
    assert list(msg.info.startup_phases) == ["download", "init", "weights", "warmup"]
    assert msg.info.startup_phases["download"] == 2.0 and msg.info.kv_pool_tokens == 4096
    assert WORKER.startup_phases == {"init": 0.25, "weights": 1.5, "warmup": 0.125}  # the worker's copy kept
    engine = msg.engine
    assert (engine.max_model_len, engine.num_blocks, engine.max_token_chars) == (512, 1024, 12)
    assert engine.served_model_name == "served" and engine.enable_metrics
    assert 5.0 <= engine.startup_seconds < 60
