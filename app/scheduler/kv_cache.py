"""KV block pool with a prefix cache: the scheduler's view of the worker's KV memory.

The worker holds the KV tensors; this module only decides which block ids hold what. Blocks are
fixed-size (block_size tokens). A block that is full of tokens is identified by a chained hash of
its tokens and its parent's hash, so identical prefixes map to identical block chains and can be
shared by reference count. Unreferenced blocks stay cached until their memory is needed: free
blocks are reused in least-recently-freed order, and a cached block is evicted (unhashed) only
when it is taken for new content.

With KV cache events on (an events recorder is given), every full block also carries its event hash
(64-bit FNV-1a of its tokens and its parent block's event hash, app/scheduler/block_hash.py),
computed once when the block is registered from the parent's cached value; registrations and
evictions are reported to the recorder as BlockStored / BlockRemoved.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.scheduler.block_hash import block_hash

if TYPE_CHECKING:
    from app.metrics.kv_events import KVEventRecorder

# A block's identity: (parent block's hash or None, the block's token ids).
BlockKey = tuple[int | None, tuple[int, ...]]


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None  # set while the block is registered in the prefix cache
    hash: int | None = None
    # KV-event hash of the block's current content (events on only); kept across eviction while
    # the block is still referenced, since children registered later chain from it.
    event_hash: int | None = None


class OutOfBlocks(Exception):
    pass


def chain_hash(parent: int | None, tokens: Sequence[int]) -> tuple[BlockKey, int]:
    key = (parent, tuple(tokens))
    return key, hash(key)


class KVCacheManager:
    """Block allocation, reference counts, prefix-cache lookups and LRU eviction."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_evict: Callable[[Block], None] | None = None,
        events: KVEventRecorder | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks, oldest-freed first; cached ones among them can still be hit.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockKey, int] = {}  # key -> block id
        self._on_evict = on_evict
        self._events = events

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids caching the longest prefix of token_ids made of full blocks.

        The last token is never covered: its logits must be computed, so at most
        (len - 1) // block_size blocks match.
        """
        if not self.enable_prefix_caching:
            return []
        matched: list[int] = []
        parent: int | None = None
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            key, h = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block_id = self._cached.get(key)
            if block_id is None:
                break
            matched.append(block_id)
            parent = h
        return matched

    # ------------------------------------------------------------------ mutations

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks returned by match_prefix."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def allocate(self, count: int) -> list[int]:
        """Take count fresh blocks (evicting cached content if needed), all or none."""
        if count > len(self._free):
            raise OutOfBlocks(f"need {count} blocks, {len(self._free)} free")
        out = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:
                self._evict(block)
            block.ref_count = 1
            block.event_hash = None  # new content
            out.append(block_id)
        return out

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; unreferenced ones become free (still cached).

        Released in reverse so a sequence's tail blocks are reused before its head blocks,
        which are the ones other requests are likeliest to share.
        """
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def register(
        self, block_id: int, parent_hash: int | None, tokens: Sequence[int], parent_block: int | None = None
    ) -> int:
        """Record that a referenced, now full block holds tokens after parent; returns its hash.

        parent_block is the block id before it in the sequence (None for the first block): with
        KV events on, the block's event hash chains from that block's cached event hash.
        If an identical block is cached already the new one stays private (the next
        request will hit the existing one).
        """
        key, h = chain_hash(parent_hash, tokens)
        if not self.enable_prefix_caching:
            return h
        block = self.blocks[block_id]
        parent_event = None
        if self._events is not None:
            parent_event = self.blocks[parent_block].event_hash if parent_block is not None else None
            block.event_hash = block_hash(parent_event, tokens)
        if block.key is None and key not in self._cached:
            block.key, block.hash = key, h
            self._cached[key] = block_id
            if self._events is not None:
                assert block.event_hash is not None
                self._events.stored(block.event_hash, parent_event, tokens)
        return h

    def flush(self) -> int:
        """Forget every cached prefix (referenced blocks stay allocated); returns the count."""
        count = 0
        for block_id in list(self._cached.values()):
            self._evict(self.blocks[block_id])
            count += 1
        return count

    def _evict(self, block: Block) -> None:
        assert block.key is not None
        del self._cached[block.key]
        if self._on_evict is not None:
            self._on_evict(block)
        if self._events is not None and block.event_hash is not None:
            self._events.removed(block.event_hash)
        block.key, block.hash = None, None

    def check_invariants(self) -> None:
        """For tests: free list, reference counts and the cache index agree."""
        for block in self.blocks:
            assert block.ref_count >= 0
            assert (block.ref_count == 0) == (block.block_id in self._free), block
            if block.key is not None:
                assert self._cached[block.key] == block.block_id
        assert len(self._cached) == sum(b.key is not None for b in self.blocks)
