"""Two data-parallel replicas behind one HTTP front (--data-parallel-size 2), the whole appliance on CPU.

One appliance for the module; its last test kills replica 1's worker, so keep that test last. Which replica
serves a request is read from /v1/loads while generation is paused, from the per-replica metrics
(prefix_cache_queries counts every prompt token a replica admits) and from each replica's KV events.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tests.support.appliance import Appliance

BLOCK = 4
FLAGS = ("--enable-metrics", "--block-size", str(BLOCK), "--max-total-tokens", "512", "--max-num-seqs", "8")
PROMPTS = [list(range(20 + 7 * i, 31 + 9 * i)) for i in range(3)]  # 11, 13, 15 tokens
MAX_NEW = 8


def generate(app: Appliance, ids: list[int], max_new: int = MAX_NEW) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(f"{app.base_url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def queries(app: Appliance) -> dict[str, float]:
    """prefix_cache_queries_total by dp_rank: the prompt tokens each replica has admitted."""
    text = httpx.get(f"{app.base_url}/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {s.labels["dp_rank"]: s.value for s in families["tokenspeed:prefix_cache_queries"].samples
            if s.name.endswith("_total")}


@pytest.fixture(scope="module")
def reference(tiny_model_dirs, log_dir) -> list[list[int]]:
    """Greedy outputs of PROMPTS from one replica (--data-parallel-size 1), same weights and flags."""
    with Appliance(tiny_model_dirs["llama"], *FLAGS, log_dir=log_dir) as app:
        return [generate(app, ids) for ids in PROMPTS]


@pytest.fixture(scope="module")
def events_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dp-kv-events")


@pytest.fixture(scope="module")
def app(tiny_model_dirs, log_dir, events_dir, reference):  # the reference runs first: one appliance at a time
    events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{events_dir}/pub.sock",
              "replay_endpoint": f"ipc://{events_dir}/replay.sock"}
    flags = (*FLAGS, "--data-parallel-size", "2", "--kv-events-config", json.dumps(events))
    with Appliance(tiny_model_dirs["llama"], *flags, log_dir=log_dir) as appliance:
        yield appliance


def test_loads_has_one_entry_per_replica(app) -> None:
    entries = app.loads()
    assert [e["dp_rank"] for e in entries] == [0, 1]
    for e in entries:
        assert (e["num_reqs"], e["num_waiting_reqs"], e["num_pages"]) == (0, 0, 0)
        assert e["num_blocks"] == 512 // BLOCK
    assert set(queries(app)) == {"0", "1"}  # both replicas' engine metrics, told apart by dp_rank


def post(app: Appliance, route: str) -> None:
    r = httpx.post(f"{app.base_url}{route}", timeout=30)
    assert r.status_code == 200 and r.json()["success"], r.text


def wait_waiting(app: Appliance, expected: list[int]) -> None:
    deadline = time.monotonic() + 30
    while (waiting := [e["num_waiting_reqs"] for e in app.loads()]) != expected:
        assert time.monotonic() < deadline, f"waiting requests per replica: {waiting}, expected {expected}"
        time.sleep(0.05)


def on_both_replicas(app: Appliance, ids: list[int]) -> list[list[int]]:
    """The same prompt on each replica, alone there: with generation paused, shortest_queue sends the first
    copy to replica 0 and the second (replica 0 holds one now) to replica 1."""
    post(app, "/pause_generation")
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(generate, app, ids)
            wait_waiting(app, [1, 0])
            second = pool.submit(generate, app, ids)
            wait_waiting(app, [1, 1])
            post(app, "/continue_generation")
            return [first.result(), second.result()]
    finally:
        post(app, "/continue_generation")


def test_both_replicas_answer_like_one_replica(app, reference) -> None:
    before = queries(app)
    for ids, expected in zip(PROMPTS, reference, strict=True):
        assert on_both_replicas(app, ids) == [expected, expected]
    after = queries(app)
    assert [after[d] - before[d] for d in ("0", "1")] == [sum(map(len, PROMPTS))] * 2


def test_sequential_requests_go_to_the_first_replica(app) -> None:
    """shortest_queue: each request is over before the next comes, so every one finds both replicas idle."""
    before = queries(app)
    work = [list(range(200 + i, 209 + 2 * i)) for i in range(3)]
    for ids in work:
        assert len(generate(app, ids)) == MAX_NEW
    after = queries(app)
    assert (after["0"] - before["0"], after["1"] - before["1"]) == (sum(map(len, work)), 0)


def test_concurrent_requests_spread_over_both_replicas(app) -> None:
    before = queries(app)
    work = [list(range(100 + 3 * i, 112 + 3 * i)) for i in range(6)]
    with ThreadPoolExecutor(len(work)) as pool:
        outs = list(pool.map(lambda ids: generate(app, ids, 16), work))
    assert all(len(o) == 16 for o in outs)
    after = queries(app)
    per_replica = [after[d] - before[d] for d in ("0", "1")]
    assert sum(per_replica) == sum(map(len, work)) and min(per_replica) > 0, per_replica


def replay(endpoint: str) -> list[tuple[list, int]]:
    """Every kept KV-event batch of one replica's replay socket: (events, attn_dp_rank)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        batches = []
        while True:
            assert sock.poll(10_000), f"no replay from {endpoint}"
            _, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return batches
            _ts, events, rank = msgpack.unpackb(payload)
            batches.append((events, rank))
    finally:
        sock.close()
        ctx.term()


def test_each_replica_publishes_kv_events_on_its_own_socket(app, events_dir) -> None:
    for rank, suffix in ((0, ""), (1, "_dp1")):
        assert os.path.exists(f"{events_dir}/pub.sock{suffix}")
        batches = replay(f"ipc://{events_dir}/replay.sock{suffix}")
        assert batches and {r for _, r in batches} == {rank}
        assert any(e[0] == "BlockStored" for events, _ in batches for e in events)


def test_flush_cache_flushes_every_replica(app) -> None:
    assert all(e["num_cached_blocks"] > 0 for e in app.loads())  # both replicas served prompts above
    r = httpx.get(f"{app.base_url}/flush_cache", timeout=30)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert r.json()["message"].startswith(("Cache flushed", "replica 0: Cache flushed")), r.text
    assert [e["num_cached_blocks"] for e in app.loads()] == [0, 0]


def test_killing_one_replicas_worker_stops_the_appliance(app) -> None:
    """Last: the appliance goes down (non-zero exit, no processes left), as the supervisor's policy says."""
    os.kill(app.child_pid("worker1.0"), signal.SIGKILL)
    app.proc.wait(timeout=30)
    assert app.proc.returncode not in (0, None)
    assert "worker1.0 (pid" in app.logs() and "died" in app.logs()
    time.sleep(0.5)
    assert app.leftover_processes() == []
