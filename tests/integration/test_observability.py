"""Observability of the whole appliance: /metrics after a known workload, the request-stats line, the
decode and request logs, and KV cache events on a plain ZMQ subscriber. One appliance for the module."""

from __future__ import annotations

import ast
import json
import re
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from app.startup_phases import PHASES
from tests.support.appliance import Appliance

BLOCK = 4
KEY = "sk-observe"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXPECTED_TYPES = {  # docs/metrics.md
    "num_requests_running": "gauge", "num_requests_waiting": "gauge", "kv_cache_usage_perc": "gauge",
    "prefix_cache_hits": "counter", "prefix_cache_queries": "counter", "prompt_tokens": "counter",
    "generation_tokens": "counter", "num_requests": "counter", "request_success": "counter",
    "num_preemptions": "counter", "iteration_tokens_total": "histogram", "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram", "request_time_per_output_token_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
    "startup_time_seconds": "gauge",
}


@pytest.fixture(scope="module")
def events_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-events")


@pytest.fixture(scope="module")
def app(tiny_model_dirs, log_dir, events_dir):
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{events_dir}/pub.sock",
              "topic": "kv-events", "replay_endpoint": f"ipc://{events_dir}/replay.sock", "buffer_steps": 1000}
    flags = ("--enable-metrics", "--enable-log-request-stats", "--enable-log-requests", "--decode-log-interval", "3",
             "--log-level-http", "debug",
             "--api-key", KEY, "--block-size", str(BLOCK), "--max-total-tokens", "4096", "--chunked-prefill-size",
             "64", "--kv-events-config", json.dumps(events))
    with Appliance(tiny_model_dirs["llama"], *flags, log_dir=log_dir) as appliance:
        yield appliance


def test_start_up_phases_are_logged_reported_and_summed_up(app: Appliance) -> None:
    logs = app.logs()
    for phase in PHASES[1:]:  # the worker's; download is the supervisor's
        assert f"start-up phase {phase}: started" in logs, phase
        assert re.search(rf"start-up phase {phase}: done in \d+\.\d s", logs), phase
    assert re.search(r"ready on http://\S+ in [\d.]+ s \(serving .*\); start-up phases: download [\d.]+ s, "
                     r"init [\d.]+ s, weights [\d.]+ s, kernels [\d.]+ s, memory_profile [\d.]+ s, graph_capture [\d.]+ s, "
                     r"warmup [\d.]+ s", logs)
    # Until ready, /readiness said where start-up was.
    assert app.unready, "the appliance was ready at its first /readiness"
    assert {body["phase"] for body in app.unready} <= {"starting", *PHASES}
    assert all(body["status"] == "not ready" for body in app.unready)


def generate(app: Appliance, ids: list[int], max_new: int, **extra) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
            **extra}
    r = httpx.post(f"{app.base_url}/generate", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def scrape(app: Appliance) -> dict:
    r = httpx.get(f"{app.base_url}/metrics", timeout=30)  # no API key: /metrics is open
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def sample(families: dict, name: str, suffix: str = "", **labels: str) -> float:
    family = families[f"tokenspeed:{name}"]
    total = 0.0
    for s in family.samples:
        if s.name == f"tokenspeed:{name}{suffix}" and all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
    return total


def wait_idle(app: Appliance, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        families = scrape(app)
        if sample(families, "num_requests_running") == 0 and sample(families, "num_requests_waiting") == 0:
            return families
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.1)


def test_metrics_count_a_known_workload(app) -> None:
    assert httpx.get(f"{app.base_url}/v1/models", timeout=10).status_code == 401  # the key guards the rest
    before = wait_idle(app)
    workload = [(list(range(10 + i, 30 + 3 * i)), 5 + i) for i in range(4)]  # (prompt, max_new_tokens)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda w: generate(app, *w), workload))
    assert [len(o["output_ids"]) for o in outs] == [n for _, n in workload]
    after = wait_idle(app)

    def delta(name: str, suffix: str = "", **labels: str) -> float:
        return sample(after, name, suffix, **labels) - sample(before, name, suffix, **labels)

    n, prompt, gen = len(workload), sum(len(p) for p, _ in workload), sum(m for _, m in workload)
    assert delta("num_requests", "_total") == n
    assert delta("request_success", "_total", finished_reason="length") == n
    assert delta("request_success", "_total", finished_reason="stop") == 0
    assert delta("prompt_tokens", "_total") == prompt
    assert delta("generation_tokens", "_total") == gen
    assert delta("prefix_cache_queries", "_total") == prompt
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_time_per_output_token_seconds", "request_queue_time_seconds"):
        assert delta(hist, "_count") == n, hist
        assert delta(hist, "_bucket", le="+Inf") == n, hist
    assert delta("inter_token_latency_seconds", "_count") == gen - n
    assert delta("iteration_tokens_total", "_sum") == prompt + gen - n  # every token fed once, no preemption
    assert delta("num_preemptions", "_total") == 0
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert sample(after, gauge) == 0, gauge
    # The same prompt again hits the prefix cache for its full blocks but the last token's.
    ids = workload[0][0]
    generate(app, ids, 2)
    again = wait_idle(app)
    hits = sample(again, "prefix_cache_hits", "_total") - sample(after, "prefix_cache_hits", "_total")
    assert hits == (len(ids) - 1) // BLOCK * BLOCK
    # Names, types and labels as documented.
    for name, kind in EXPECTED_TYPES.items():
        assert again[f"tokenspeed:{name}"].type == kind, name
    assert {s.labels["dp_rank"] for s in again["tokenspeed:num_requests_running"].samples} == {"0"}
    phases = {s.labels["phase"]: s.value for s in again["tokenspeed:startup_time_seconds"].samples}
    assert set(phases) == {*PHASES, "total"}
    assert phases["total"] >= phases["weights"] > 0
    bucket_bounds = [float(s.labels["le"]) for s in again["tokenspeed:inter_token_latency_seconds"].samples
                     if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
    assert min(bucket_bounds) == 0.001


ENGINE_INFO_KEYS = {  # docs/api.md: the worker's start-up figures, then what requests are checked against
    "weights_gb", "kv_pool_tokens", "max_concurrency", "load_seconds", "dtype", "device", "architecture",
    "attention_backend", "decode_kernel", "cuda_graph_sizes", "piecewise_graph_sizes", "pdl", "cuda_graph_gb",
    "quantization", "kv_cache_dtype", "startup_phases",
    "max_model_len", "vocab_size", "eos_token_ids", "num_blocks", "block_size", "sampling_backend",
    "max_top_logprobs", "max_token_chars", "served_model_name", "enable_metrics", "startup_seconds",
}


def test_server_info_reports_the_engine_as_metrics_do(app: Appliance) -> None:
    info = httpx.get(f"{app.base_url}/get_server_info", headers=AUTH, timeout=10).json()["engine_info"]
    assert set(info) == ENGINE_INFO_KEYS
    assert (info["kv_pool_tokens"], info["block_size"], info["device"], info["quantization"]) == (4096, BLOCK, "cpu",
                                                                                                 "none")
    assert info["architecture"] == "LlamaForCausalLM" and info["attention_backend"] == "torch"
    phases = {s.labels["phase"]: s.value for s in scrape(app)["tokenspeed:startup_time_seconds"].samples}
    assert phases == {**info["startup_phases"], "total": info["startup_seconds"]}
    assert set(info["startup_phases"]) == set(PHASES)  # the supervisor's download and the worker's phases


STATS = re.compile(r"Req: (\S+) Finish! RequestStats\((.*)\)$")


def stats_lines(app: Appliance) -> dict[str, dict]:
    out = {}
    for line in app.logs().splitlines():
        if m := STATS.search(line):
            out[m.group(1)] = {k: ast.literal_eval(v) for k, v in re.findall(r"(\w+)=('[^']*'|[^,]+)", m.group(2))}
    return out


def test_request_stats_lines(app) -> None:
    ids = list(range(40, 61))
    rid = generate(app, ids, 6)["meta_info"]["id"]
    shared = generate(app, ids, 3)["meta_info"]["id"]  # 20 of its 21 prompt tokens are cached
    # One aborted mid-generation: a long streaming request, then /abort_request.
    stream_rid = "stats-abort"

    streaming = threading.Event()

    def long_stream() -> None:
        body = {"input_ids": [5, 6, 7], "stream": True, "rid": stream_rid,
                "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
        with httpx.stream("POST", f"{app.base_url}/generate", json=body, headers=AUTH, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    streaming.set()

    streamer = threading.Thread(target=long_stream)
    streamer.start()
    # Abort once tokens flow, not after a fixed wait: a fast machine finished all 400 within one.
    assert streaming.wait(30), "the stream sent nothing"
    httpx.post(f"{app.base_url}/abort_request", json={"rid": stream_rid}, headers=AUTH, timeout=30)
    streamer.join(60)
    deadline = time.monotonic() + 10
    while not {rid, shared, stream_rid} <= set(lines := stats_lines(app)):
        assert time.monotonic() < deadline, "stats lines missing"
        time.sleep(0.1)
    fields = ["status", "reason", "prompt_tokens", "cache_tokens", "output_tokens", "cache_hit_rate", "queue_ms",
              "prefill_ms", "ttft_ms", "total_ms", "preempt_ms", "preempt_count", "decode_tps", "acc_len", "acc_rate",
              "recv_ts", "commit_ts", "finish_ts"]
    for r in (rid, shared, stream_rid):
        s = lines[r]
        assert list(s) == fields
        assert s["ttft_ms"] >= s["prefill_ms"] >= 0 and s["total_ms"] >= s["ttft_ms"] and s["queue_ms"] >= 0
        assert s["cache_hit_rate"] == round(s["cache_tokens"] / s["prompt_tokens"], 4)
        assert s["recv_ts"] <= s["commit_ts"] <= s["finish_ts"] and s["acc_len"] is None
    first, second, aborted = lines[rid], lines[shared], lines[stream_rid]
    assert (first["status"], first["reason"], first["prompt_tokens"], first["output_tokens"]) == (
        "finished", "length", 21, 6)
    assert second["cache_tokens"] == 20 and second["cache_hit_rate"] == round(20 / 21, 4)
    assert first["decode_tps"] > 0
    assert (aborted["status"], aborted["reason"]) == ("aborted", "abort") and 0 < aborted["output_tokens"] < 400


def test_decode_and_request_logs(app) -> None:
    generate(app, list(range(3, 12)), 8)
    logs = app.logs()
    decode = re.findall(r"Decode batch\. #running-req: (\d+), #queue-req: (\d+), KV usage: ([\d.]+) .*"
                        r"gen throughput \(token/s\): ([\d.]+)", logs)
    assert decode and any(float(tps) > 0 for *_, tps in decode)
    assert all(0 <= float(usage) <= 1 for _, _, usage, _ in decode)
    assert re.search(r"request rid=\S+ route=/generate prompt_len=\[9\]", logs)
    assert re.search(r"finish rid=\S+ status=200 finish_reason=\['length'\] completion_tokens=\[8\]", logs)
    assert re.search(r'"POST /generate HTTP/1.1" 200', logs)  # --log-level-http debug: uvicorn's access log
    assert "DEBUG tokenspeed.scheduler" not in logs  # while --log-level info keeps the engine at info


# ---------------------------------------------------------------- KV cache events


def fnv(parent: int | None, tokens: list[int]) -> int:
    """The block hash as docs/kv-events.md specifies it, independently of the appliance's code."""
    data = bytes([parent is not None]) + (struct.pack("<Q", parent) if parent is not None else b"")
    data += struct.pack("<Q", len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens)
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) % 2**64
    return h


class Subscriber:
    def __init__(self, endpoint: str, topic: bytes) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.batches: list[tuple[int, list]] = []

    def drain(self, until, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, f"no matching event in {timeout}s"
            if self.sock.poll(100):
                topic, seq, payload = self.sock.recv_multipart()
                assert topic == b"kv-events" and len(seq) == 8
                ts, events, rank = msgpack.unpackb(payload)
                assert rank == 0 and abs(ts - time.time()) < 60
                self.batches.append((int.from_bytes(seq, "big"), events))

    def events(self, kind: str) -> list:
        return [e for _, batch in self.batches for e in batch if e[0] == kind]

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def test_kv_events_for_a_prompt_then_a_flush_and_replay(app, events_dir) -> None:
    sub = Subscriber(f"ipc://{events_dir}/pub.sock", b"kv-events")
    try:
        time.sleep(0.5)  # let the subscription reach the publisher
        prompt = list(range(200, 223))  # 23 tokens: 5 full blocks once the prompt is computed
        generate(app, prompt, 1)
        full = [prompt[i:i + BLOCK] for i in range(0, len(prompt) // BLOCK * BLOCK, BLOCK)]
        sub.drain(lambda: [e[3] for e in sub.events("BlockStored")][:len(full)] == full)
        stored = sub.events("BlockStored")[:len(full)]
        parent = None
        for _, hashes, parent_hash, tokens, size in stored:
            assert (parent_hash, size) == (parent, BLOCK) and hashes == [fnv(parent, tokens)]
            parent = hashes[0]
        ours = {e[1][0] for e in stored}
        r = httpx.post(f"{app.base_url}/flush_cache", headers=AUTH, timeout=30)
        assert r.status_code == 200
        sub.drain(lambda: ours <= {e[1][0] for e in sub.events("BlockRemoved")})
        seqs = [s for s, _ in sub.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive: nothing lost or reordered

        dealer = sub.ctx.socket(zmq.DEALER)
        dealer.connect(f"ipc://{events_dir}/replay.sock")
        dealer.send_multipart([b"", seqs[0].to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            seq_no = int.from_bytes(seq, "big", signed=True)
            if seq_no == -1:
                assert payload == b""
                break
            replayed.append((seq_no, msgpack.unpackb(payload)[1]))
        assert replayed[:len(sub.batches)] == sub.batches
    finally:
        sub.close()
