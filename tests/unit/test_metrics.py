"""Prometheus metrics: the catalog, the scheduler's and the tokenizer's recorders, multiprocess merging,
and the /metrics route."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from app import protocol as p
from app.metrics.catalog import SPECS, build
from app.metrics.engine import EngineMetrics
from app.metrics.exposition import StartupMetrics
from app.metrics.frontend import FrontendMetrics
from app.scheduler.scheduler import Scheduler, SchedulerConfig
from app.tokenizer.core import TokenizerCore
from tests.unit.test_http_fakes import FakeEngine, asgi_client

REPO = Path(__file__).resolve().parents[2]
ENGINE = {"model_name": "m", "dp_rank": "0"}
FRONT = {"model_name": "m"}


def value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    got = reg.get_sample_value(name, labels)
    return 0.0 if got is None else got


def test_catalog_names_types_and_docs() -> None:
    assert all(s.full_name.startswith("tokenspeed:") for s in SPECS)
    assert len({s.name for s in SPECS}) == len(SPECS)
    assert min(SPECS[[s.name for s in SPECS].index("inter_token_latency_seconds")].buckets) == 0.001
    doc = (REPO / "docs" / "metrics.md").read_text()
    for spec in SPECS:  # every metric is documented with its type
        assert re.search(rf"`{re.escape(spec.full_name)}`[^|]*\|\s*{spec.kind}", doc), spec.full_name
    # The dashboard queries only metrics that exist.
    board = json.loads((REPO / "monitoring" / "grafana" / "dashboards" / "tokenspeed.json").read_text())
    exposed = {s.full_name + suffix for s in SPECS for suffix in {
        "counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}[s.kind]}
    queries = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    queries += [v["query"] if isinstance(v["query"], str) else v["query"].get("query", "")
                for v in board.get("templating", {}).get("list", []) if "query" in v]
    used = {name for q in queries for name in re.findall(r"tokenspeed:[a-z0-9_]+", q)}
    assert used and used <= exposed, used - exposed


def scheduler(num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=4, max_model_len=128, max_num_seqs=4,
                                     chunked_prefill_size=64, max_prefill_tokens=128, enable_prefix_caching=True,
                                     eos_token_ids=(0,)))


def sample_all(plan: p.StepPlan) -> p.StepResult:
    slots = [c.slot for c in plan.chunks if c.sample]
    return p.StepResult(step=plan.step, slots=slots, token_ids=[7] * len(slots))


def test_engine_metrics_follow_the_scheduler() -> None:
    reg = CollectorRegistry()
    sched = scheduler()
    metrics = EngineMetrics(sched, "m", registry=reg)
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks are reusable
    for rid in ("a", "b"):
        sched.add_request(p.TokenizedRequest(rid, prompt, p.SamplingParams(max_new_tokens=3, temperature=0)))
        steps = 0
        while (plan := sched.schedule()) is not None:
            metrics.planned(sched.last_step_tokens)
            sched.process_result(sample_all(plan))
            metrics.update()
            steps += 1
            if rid == "a" and steps == 1:  # mid-flight: one running, a quarter of the pool or so in use
                assert value(reg, "tokenspeed:num_requests_running", **ENGINE) == 1
                assert 0 < value(reg, "tokenspeed:kv_cache_usage_perc", **ENGINE) < 1
    metrics.update()
    assert value(reg, "tokenspeed:prefix_cache_queries_total", **ENGINE) == 34
    assert value(reg, "tokenspeed:prefix_cache_hits_total", **ENGINE) == 16
    assert value(reg, "tokenspeed:request_queue_time_seconds_count", **ENGINE) == 2
    # Steps: a prefill of 17 then 2 decodes for "a"; a prefill of 1 (16 cached) then 2 decodes for "b".
    assert value(reg, "tokenspeed:iteration_tokens_total_count", **ENGINE) == 6
    assert value(reg, "tokenspeed:iteration_tokens_total_sum", **ENGINE) == 17 + 2 + 1 + 2
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert value(reg, f"tokenspeed:{gauge}", **ENGINE) == 0
    sched.num_preemptions += 3
    metrics.update()
    metrics.update()
    assert value(reg, "tokenspeed:num_preemptions_total", **ENGINE) == 3


def test_frontend_metrics_latencies_and_counters() -> None:
    reg = CollectorRegistry()
    m = FrontendMetrics("m", registry=reg)
    m.admitted("r", 100.0, prompt_tokens=5)
    m.admitted("s", 100.0, prompt_tokens=2)
    m.tokens([p.TokenDelta("r", [1]), p.TokenDelta("unknown", [1])], 100.5)  # TTFT 0.5
    m.tokens([p.TokenDelta("r", [2])], 100.52)  # ITL 0.02
    m.tokens([p.TokenDelta("r", [3, 4])], 100.56)  # two tokens in one delta: 0.02 each
    m.finished("r", "length", 100.56)
    m.tokens([p.TokenDelta("s", [9])], 101.0)
    m.finished("s", None, 101.0)  # failed: counted, but no success and no e2e
    m.finished("never-admitted", "stop", 101.0)
    assert value(reg, "tokenspeed:time_to_first_token_seconds_count", **FRONT) == 2
    assert value(reg, "tokenspeed:time_to_first_token_seconds_sum", **FRONT) == pytest.approx(0.5 + 1.0)
    assert value(reg, "tokenspeed:inter_token_latency_seconds_count", **FRONT) == 3
    assert value(reg, "tokenspeed:inter_token_latency_seconds_sum", **FRONT) == pytest.approx(0.06)
    assert value(reg, "tokenspeed:inter_token_latency_seconds_bucket", le="0.001", **FRONT) == 0
    assert value(reg, "tokenspeed:inter_token_latency_seconds_bucket", le="0.025", **FRONT) == 3
    assert value(reg, "tokenspeed:e2e_request_latency_seconds_count", **FRONT) == 1
    assert value(reg, "tokenspeed:e2e_request_latency_seconds_sum", **FRONT) == pytest.approx(0.56)
    assert value(reg, "tokenspeed:request_time_per_output_token_seconds_sum", **FRONT) == pytest.approx(0.02)
    assert value(reg, "tokenspeed:num_requests_total", **FRONT) == 2
    assert value(reg, "tokenspeed:prompt_tokens_total", **FRONT) == 7
    assert value(reg, "tokenspeed:generation_tokens_total", **FRONT) == 5
    assert value(reg, "tokenspeed:request_success_total", finished_reason="length", **FRONT) == 1
    assert value(reg, "tokenspeed:request_success_total", finished_reason="stop", **FRONT) == 0


def test_the_tokenizer_records_requests_it_admits() -> None:
    reg = CollectorRegistry()
    core = TokenizerCore(None, metrics=FrontendMetrics("m", registry=reg))
    core.handle(p.EngineReady(engine=p.EngineInfo(max_model_len=64, vocab_size=100, eos_token_ids=[2])))
    core.handle(p.GenerateRequest("r", p.SamplingParams(max_new_tokens=4), input_ids=[5, 6, 7], arrival_time=1.0))
    core.handle(p.TokenDeltas([p.TokenDelta("r", [8], prompt_tokens=3, completion_tokens=1)], 1.25))
    core.handle(p.TokenDeltas([p.TokenDelta("r", [9], finish_reason="stop", matched_stop=9, prompt_tokens=3,
                                            completion_tokens=2)], 1.5))
    assert value(reg, "tokenspeed:time_to_first_token_seconds_sum", **FRONT) == pytest.approx(0.25)
    assert value(reg, "tokenspeed:e2e_request_latency_seconds_sum", **FRONT) == pytest.approx(0.5)
    assert value(reg, "tokenspeed:request_success_total", finished_reason="stop", **FRONT) == 1
    assert value(reg, "tokenspeed:prompt_tokens_total", **FRONT) == 3


def test_metrics_start_with_the_engine_when_engine_ready_says_so() -> None:
    core = TokenizerCore(None)
    core.handle(p.EngineReady(engine=p.EngineInfo(max_model_len=64, vocab_size=100, enable_metrics=True,
                               served_model_name="m")))
    assert isinstance(core._metrics, FrontendMetrics)
    plain = TokenizerCore(None)
    plain.handle(p.EngineReady(engine=p.EngineInfo(max_model_len=64, vocab_size=100)))
    assert plain._metrics is None


def test_startup_phases() -> None:
    reg = CollectorRegistry()
    startup = StartupMetrics("m", registry=reg)
    startup.record({"weights": 1.5, "kv_pool": 0.25, "graphs": 0.0, "warmup": 0.5, "total": 9.0})
    phases = {ph: value(reg, "tokenspeed:startup_time_seconds", model_name="m", phase=ph)
              for ph in ("weights", "kv_pool", "graphs", "warmup", "total")}
    assert phases == {"weights": 1.5, "kv_pool": 0.25, "graphs": 0.0, "warmup": 0.5, "total": 9.0}
    assert startup.recorded


_WRITER = """
import sys
from app.metrics.catalog import build
m = build(("prompt_tokens", "num_requests_running"))
m["prompt_tokens"].labels(model_name="m").inc(int(sys.argv[1]))
m["num_requests_running"].labels(model_name="m", dp_rank=sys.argv[2]).set(int(sys.argv[1]))
"""
_READER = "import sys; from app.metrics.exposition import exposition; sys.stdout.write(exposition()[0].decode())"


def test_multiprocess_mode_merges_every_process(tmp_path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    for amount, rank in (("3", "0"), ("4", "1")):
        subprocess.run([sys.executable, "-c", _WRITER, amount, rank], env=env, check=True, cwd=REPO)
    text = subprocess.run([sys.executable, "-c", _READER], env=env, check=True, cwd=REPO,
                          capture_output=True, text=True).stdout
    families = {f.name: f for f in text_string_to_metric_families(text)}
    prompt = families["tokenspeed:prompt_tokens"]
    assert prompt.type == "counter"
    assert [(s.name, s.value) for s in prompt.samples] == [("tokenspeed:prompt_tokens_total", 7.0)]
    running = {s.labels["dp_rank"]: s.value for s in families["tokenspeed:num_requests_running"].samples}
    assert running == {"0": 3.0, "1": 4.0}


def test_observe_many_equals_repeated_observations() -> None:
    one, many = CollectorRegistry(), CollectorRegistry()
    single = build(("inter_token_latency_seconds",), one)["inter_token_latency_seconds"].labels(model_name="m")
    batch = build(("inter_token_latency_seconds",), many)["inter_token_latency_seconds"].labels(model_name="m")
    for amount, count in ((0.0004, 3), (0.02, 5), (7.0, 2), (0.3, 0)):
        for _ in range(count):
            single.observe(amount)
        batch.observe_many(amount, count)
    def samples(reg: CollectorRegistry) -> list:
        return [(s.name, s.labels, s.value) for s in list(reg.collect())[0].samples if not s.name.endswith("_created")]

    assert samples(one) == samples(many) and len(samples(one)) > 20


def test_build_refuses_unknown_names() -> None:
    with pytest.raises(KeyError):
        build(("no_such_metric",))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_metrics_route_is_open_without_the_key_and_absent_without_the_flag() -> None:
    async with asgi_client(FakeEngine(), api_key="sk-secret", enable_metrics=True) as c:
        scrape = await c.get("/metrics")
        denied = await c.get("/v1/models")
    assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
    list(text_string_to_metric_families(scrape.text))  # parses
    assert denied.status_code == 401
    async with asgi_client(FakeEngine()) as c:
        assert (await c.get("/metrics")).status_code == 404
    async with asgi_client(FakeEngine(), api_key="sk-secret") as c:  # no metrics: no open door either
        assert (await c.get("/metrics")).status_code == 401
