"""Block pool and prefix cache: property tests that references always balance."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.scheduler.kv_cache import KVCacheManager, OutOfBlocks


def test_allocate_release_and_reuse_cached_prefix() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(12))
    blocks = kv.allocate(3)
    parent = None
    for i, b in enumerate(blocks):
        parent = kv.register(b, parent, tokens[i * 4 : (i + 1) * 4])
    kv.release(blocks)
    assert kv.num_free_blocks == 8 and kv.num_cached_blocks == 3
    # The last token is always recomputed: 12 tokens match 2 blocks, 13 tokens match 3.
    assert kv.match_prefix(tokens) == blocks[:2]
    assert kv.match_prefix(tokens + [99]) == blocks
    assert kv.match_prefix([7] + tokens[1:]) == []
    kv.check_invariants()


def test_eviction_takes_least_recently_freed_and_unhashes() -> None:
    evicted = []
    kv = KVCacheManager(num_blocks=2, block_size=2, on_evict=lambda b: evicted.append(b.block_id))
    a, b = kv.allocate(2)
    kv.register(a, None, [1, 2])
    kv.release([a])
    kv.release([b])
    (c,) = kv.allocate(1)
    assert c == a and evicted == [a]
    assert kv.match_prefix([1, 2, 3]) == []
    kv.check_invariants()


def test_out_of_blocks_and_double_free() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=2)
    blocks = kv.allocate(2)
    with pytest.raises(OutOfBlocks):
        kv.allocate(1)
    kv.release(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        kv.release(blocks[:1])


def test_shared_prefix_is_reference_counted() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    (a,) = kv.allocate(1)
    kv.register(a, None, [5, 6])
    hit = kv.match_prefix([5, 6, 7])
    kv.acquire(hit)
    assert kv.blocks[a].ref_count == 2
    kv.release([a])
    assert kv.num_free_blocks == 3
    kv.release(hit)
    assert kv.num_free_blocks == 4 and kv.num_cached_blocks == 1
    assert kv.flush() == 1 and kv.num_cached_blocks == 0
    kv.check_invariants()


ops = st.lists(
    st.tuples(st.sampled_from(["admit", "extend", "finish", "flush"]), st.integers(0, 50), st.integers(1, 12)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_sequences_keep_references_balanced(sequence) -> None:
    bs = 2
    kv = KVCacheManager(num_blocks=16, block_size=bs)
    live: list[dict] = []  # each: tokens, blocks, hashes
    for op, seed, length in sequence:
        if op == "admit":
            tokens = [(seed + i) % 3 for i in range(length)]  # few distinct prefixes: many hits
            hit = kv.match_prefix(tokens)
            kv.acquire(hit)
            need = kv.blocks_needed(len(tokens)) - len(hit)
            try:
                blocks = hit + kv.allocate(need)
            except OutOfBlocks:
                kv.release(hit)
                continue
            hashes: list[int] = []
            for i in range(len(tokens) // bs):
                parent = hashes[-1] if hashes else None
                hashes.append(kv.register(blocks[i], parent, tokens[i * bs : (i + 1) * bs]))
            live.append({"tokens": tokens, "blocks": blocks})
        elif op == "extend" and live:
            seq = live[seed % len(live)]
            try:
                seq["blocks"] += kv.allocate(1)
            except OutOfBlocks:
                pass
        elif op == "finish" and live:
            seq = live.pop(seed % len(live))
            kv.release(seq["blocks"])
        elif op == "flush":
            kv.flush()
        kv.check_invariants()
        assert kv.num_used_blocks == len({b for s in live for b in s["blocks"]})
    for seq in live:
        kv.release(seq["blocks"])
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks
