"""KV cache events: the FNV-1a block hash, the config, what the KV manager records, and the ZMQ wire."""

from __future__ import annotations

import struct
import time

import msgpack
import pytest
import zmq

from app import protocol as p
from app.config.kv_events import KVEventsConfig, kv_events_config_problem, parse_kv_events_config
from app.metrics.kv_events import END_OF_REPLAY, KVEventPublisher, KVEventRecorder
from app.scheduler.block_hash import block_hash
from app.scheduler.kv_cache import KVCacheManager
from app.scheduler.scheduler import Scheduler, SchedulerConfig


def reference_fnv(parent: int | None, tokens: list[int]) -> int:
    """FNV-1a 64 as TokenSpeed specifies it, written out byte by byte."""
    h = 14695981039346656037

    def mix(data: bytes) -> None:
        nonlocal h
        for b in data:
            h ^= b
            h = (h * 1099511628211) % 2**64

    mix(bytes([parent is not None]))
    if parent is not None:
        mix(struct.pack("<Q", parent))
    mix(struct.pack("<Q", len(tokens)))
    for t in tokens:
        mix(struct.pack("<i", t))
    return h


def test_block_hash_is_fnv1a_over_parent_count_and_int32_tokens() -> None:
    assert block_hash(None, []) == reference_fnv(None, [])
    first = block_hash(None, [1, 2, 3, 4])
    assert first == reference_fnv(None, [1, 2, 3, 4])
    assert block_hash(first, [5, 6, 7, 8]) == reference_fnv(first, [5, 6, 7, 8])
    assert block_hash(2**64 - 1, [-1, 2**31 - 1]) == reference_fnv(2**64 - 1, [-1, 2**31 - 1])
    # Every input matters: parent presence, parent value, order, count.
    assert len({block_hash(None, [1, 2]), block_hash(0, [1, 2]), block_hash(1, [1, 2]), block_hash(None, [2, 1]),
                block_hash(None, [1, 2, 0])}) == 5
    assert 0 <= first < 2**64


def test_config_defaults_validation_and_activity() -> None:
    assert parse_kv_events_config(None) is None
    assert parse_kv_events_config({}) is None  # not enabled
    assert parse_kv_events_config({"enable_kv_cache_events": True, "publisher": "null"}) is None
    cfg = parse_kv_events_config({"enable_kv_cache_events": True, "topic": "kv"})
    assert cfg == KVEventsConfig(enable_kv_cache_events=True, topic="kv")
    assert cfg.endpoint == "tcp://*:5557" and cfg.buffer_steps == 10000 and cfg.replay_endpoint is None
    for bad, word in [({"bogus": 1}, "bogus"), ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events"),
                      ({"publisher": "kafka"}, "publisher"), ({"buffer_steps": 0}, "buffer_steps"),
                      ({"max_queue_size": 5}, "max_queue_size")]:
        with pytest.raises(ValueError, match=word):
            parse_kv_events_config(bad)
        assert word in (kv_events_config_problem(bad) or "")
    assert kv_events_config_problem(None) is None
    assert kv_events_config_problem([1]) == "must be a JSON object"


def test_settings_accept_a_valid_config_and_name_a_bad_one() -> None:
    from app.config import load_settings
    from app.config.errors import ConfigError

    ok = load_settings(["/m", "--kv-events-config", '{"enable_kv_cache_events": true, "topic": "t"}'], {})
    assert ok.kv_events_config == {"enable_kv_cache_events": True, "topic": "t"}
    with pytest.raises(ConfigError, match="--kv-events-config.*docs/kv-events.md"):
        load_settings(["/m", "--kv-events-config", '{"enable_kv_cache_events": true, "nope": 1}'], {})


# ---------------------------------------------------------------- what the KV manager records


def kv_with_events(num_blocks: int = 8, block_size: int = 4) -> tuple[KVCacheManager, KVEventRecorder]:
    rec = KVEventRecorder(block_size)
    return KVCacheManager(num_blocks, block_size, True, events=rec), rec


def register_chain(kv: KVCacheManager, tokens: list[int]) -> list[int]:
    bs = kv.block_size
    blocks = kv.allocate(len(tokens) // bs)
    parent = None
    for i, block in enumerate(blocks):
        parent = kv.register(block, parent, tokens[i * bs:(i + 1) * bs], blocks[i - 1] if i else None)
    return blocks


def test_register_records_chained_block_stored_events() -> None:
    kv, rec = kv_with_events()
    tokens = list(range(10, 22))
    blocks = register_chain(kv, tokens)
    events = rec.take()
    assert [e[0] for e in events] == ["BlockStored"] * 3
    parent = None
    for i, (kind, hashes, parent_hash, ids, size) in enumerate(events):
        assert (kind, parent_hash, ids, size) == ("BlockStored", parent, tokens[i * 4:(i + 1) * 4], 4)
        assert hashes == [reference_fnv(parent, ids)] == [kv.blocks[blocks[i]].event_hash]
        parent = hashes[0]
    assert rec.take() == []


def test_duplicates_stay_private_but_keep_lineage_and_evictions_are_removed() -> None:
    kv, rec = kv_with_events(num_blocks=6)
    tokens = list(range(1, 9))
    first = register_chain(kv, tokens)
    second = register_chain(kv, tokens)  # same content: cached already, no new events
    stored = rec.take()
    assert len(stored) == 2
    assert [kv.blocks[b].event_hash for b in second] == [kv.blocks[b].event_hash for b in first]
    kv.release(first)
    kv.release(second)
    kv.allocate(6)  # takes every block: the two cached ones are evicted
    removed = rec.take()
    assert sorted(e[1][0] for e in removed) == sorted(e[1][0] for e in stored)
    assert all(e[0] == "BlockRemoved" for e in removed)
    kv.check_invariants()


def test_flush_removes_every_cached_block_and_children_still_chain_from_evicted_parents() -> None:
    kv, rec = kv_with_events()
    blocks = register_chain(kv, list(range(1, 9)))
    rec.take()
    assert kv.flush() == 2
    assert [e[0] for e in rec.take()] == ["BlockRemoved", "BlockRemoved"]
    # The request still holds its blocks: a block registered after them chains from the cached lineage.
    parent_event = kv.blocks[blocks[1]].event_hash
    (child,) = kv.allocate(1)
    kv.register(child, 123, [9, 10, 11, 12], blocks[1])
    (event,) = rec.take()
    assert event[2] == parent_event and event[1] == [reference_fnv(parent_event, [9, 10, 11, 12])]


def test_no_events_without_prefix_caching_or_a_recorder() -> None:
    rec = KVEventRecorder(4)
    kv = KVCacheManager(4, 4, False, events=rec)
    register_chain(kv, list(range(8)))
    assert rec.take() == []
    plain = KVCacheManager(4, 4, True)
    register_chain(plain, list(range(8)))
    assert all(b.event_hash is None for b in plain.blocks)


def sample_all(plan: p.StepPlan, token: int = 7) -> p.StepResult:
    """A worker that samples `token` for every chunk that asks."""
    slots = [c.slot for c in plan.chunks if c.sample]
    return p.StepResult(step=plan.step, slots=slots, token_ids=[token] * len(slots))


def test_scheduler_publishes_a_prompts_full_blocks() -> None:
    rec = KVEventRecorder(4)
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=128, max_num_seqs=4, chunked_prefill_size=64,
                          max_prefill_tokens=64, enable_prefix_caching=True, eos_token_ids=(0,))
    sched = Scheduler(cfg, kv_events=rec)
    prompt = list(range(3, 14))  # 11 tokens: 2 full blocks after the prefill
    sched.add_request(p.TokenizedRequest("r", prompt, p.SamplingParams(max_new_tokens=1, temperature=0)))
    sched.process_result(sample_all(sched.schedule()))
    stored = [e for e in rec.take() if e[0] == "BlockStored"]
    assert [e[3] for e in stored] == [prompt[0:4], prompt[4:8]]
    assert stored[1][2] == stored[0][1][0] and stored[0][2] is None


# ---------------------------------------------------------------- the wire


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def recv_batch(sub: zmq.Socket) -> tuple[bytes, int, list]:
    assert sub.poll(2000), "no event batch arrived"
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big", signed=True), msgpack.unpackb(payload)


def test_publisher_frames_sequence_and_replay(ctx, tmp_path) -> None:
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/pub.sock", topic="kv",
                            replay_endpoint=f"ipc://{tmp_path}/replay.sock", buffer_steps=2)
    pub = KVEventPublisher(config, ctx, dp_rank=0)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(config.endpoint)
    time.sleep(0.2)  # PUB/SUB: let the subscription reach the publisher
    batches = [[["BlockStored", [1], None, [1, 2], 2]], [["BlockRemoved", [1]]], [["BlockRemoved", [2]]]]
    before = time.time()
    for events in batches:
        pub.publish(events)
    got = [recv_batch(sub) for _ in batches]
    assert [(t, s) for t, s, _ in got] == [(b"kv", 0), (b"kv", 1), (b"kv", 2)]
    for (_, _, payload), events in zip(got, batches, strict=True):
        ts, evs, rank = payload
        assert evs == events and rank == 0 and before <= ts <= time.time()

    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(config.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replies = []
    while True:
        pub.serve_replay()
        if dealer.poll(50):
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            replies.append((int.from_bytes(seq, "big", signed=True), payload))
            if replies[-1][0] == END_OF_REPLAY:
                break
    # buffer_steps=2 kept the last two batches; the end marker has an empty payload.
    assert [s for s, _ in replies] == [1, 2, END_OF_REPLAY] and replies[-1][1] == b""
    assert msgpack.unpackb(replies[0][1])[1] == batches[1]
    pub.close()
