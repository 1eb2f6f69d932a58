"""The KV cache events' block hash (docs/kv-events.md): what a subscriber matches blocks by.

64-bit FNV-1a over (has_parent byte, parent hash u64 LE if any, token count u64 LE, each token id int32
LE): a block's hash depends on its tokens and its parent's hash only, so KVCacheManager caches the
lineage on its blocks and never rehashes a prefix.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

FNV_OFFSET = 14695981039346656037
FNV_PRIME = 1099511628211
_MASK64 = (1 << 64) - 1


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """64-bit FNV-1a of one block given its parent's hash (None for the first block of a sequence)."""
    data = bytearray(b"\x01" if parent is not None else b"\x00")
    if parent is not None:
        data += parent.to_bytes(8, "little")
    data += len(token_ids).to_bytes(8, "little")
    data += struct.pack(f"<{len(token_ids)}i", *token_ids)
    h = FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & _MASK64
    return h
