"""KV events with several data-parallel replicas: per-rank endpoints and attn_dp_rank on the wire."""

from __future__ import annotations

import msgpack
import pytest
import zmq

from app.config.kv_events import KVEventsConfig, endpoint_for_rank, kv_events_config_problem, rank_endpoints
from app.metrics.kv_events import KVEventPublisher


def test_endpoint_for_rank_offsets_tcp_ports_and_suffixes_local_names() -> None:
    assert endpoint_for_rank("tcp://*:5557", 0) == "tcp://*:5557"
    assert endpoint_for_rank("tcp://*:5557", 3) == "tcp://*:5560"
    assert endpoint_for_rank("tcp://[::1]:6000", 1) == "tcp://[::1]:6001"
    assert endpoint_for_rank("tcp://broker.local:7000", 2) == "tcp://broker.local:7002"
    assert endpoint_for_rank("ipc:///run/kv.sock", 1) == "ipc:///run/kv.sock_dp1"
    assert endpoint_for_rank("inproc://kv", 2) == "inproc://kv_dp2"
    with pytest.raises(ValueError, match="explicit port"):
        endpoint_for_rank("tcp://host", 1)
    with pytest.raises(ValueError, match="65535"):
        endpoint_for_rank("tcp://*:65535", 1)


def test_rank_endpoints_cover_the_replay_socket() -> None:
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5600")
    assert rank_endpoints(config, 1) == ("tcp://*:5558", "tcp://*:5601")
    assert rank_endpoints(KVEventsConfig(enable_kv_cache_events=True), 1) == ("tcp://*:5558", None)


def test_config_problem_checks_every_rank() -> None:
    value = {"enable_kv_cache_events": True, "endpoint": "tcp://*:65535"}
    assert kv_events_config_problem(value) is None
    problem = kv_events_config_problem(value, data_parallel_size=2)
    assert problem is not None and "65535" in problem
    assert kv_events_config_problem({"enable_kv_cache_events": False, "endpoint": "tcp://x"}, 4) is None  # off


def test_each_rank_publishes_on_its_own_socket_with_its_rank(tmp_path) -> None:
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/pub.sock", topic="kv")
    ctx = zmq.Context()
    publishers = [KVEventPublisher(config, ctx, dp_rank=d) for d in range(2)]
    subs = []
    try:
        for d in range(2):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv")
            sub.connect(endpoint_for_rank(config.endpoint, d))
            subs.append(sub)
        for _ in range(200):  # a SUB joins asynchronously: publish until each one has a batch
            for d, pub in enumerate(publishers):
                pub.publish([["BlockRemoved", [d]]])
            if all(sub.poll(10) for sub in subs):
                break
        for d, sub in enumerate(subs):
            topic, _seq, payload = sub.recv_multipart()
            _ts, events, rank = msgpack.unpackb(payload)
            assert (topic, events, rank) == (b"kv", [["BlockRemoved", [d]]], d)
    finally:
        for sock in subs:
            sock.close(linger=0)
        for pub in publishers:
            pub.close()
        ctx.term()
