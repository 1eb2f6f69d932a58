"""The per-slot sequence state the kernels read: every slot's block table, context length and last
sampled token on the device, mirrored by host lists that drive planning and validation. Device rows
are written only where a plan changed them, in stream order (see app/worker/model_runner.py)."""

from __future__ import annotations

import torch

from app.worker.transfer import upload


class SlotState:
    """Per-slot sequence state. Host lists drive planning and validation; the device tensors (block
    tables, lengths, last sampled token) are what kernels read, written only where a plan changed them."""

    def __init__(self, max_slots: int, max_blocks: int, device: torch.device) -> None:
        self.max_slots = max_slots
        self.max_blocks = max_blocks
        self.active = [False] * max_slots
        self.has_token = [False] * max_slots  # a sampled token is waiting to be fed (decode)
        self.seq_len = [0] * max_slots
        self.num_blocks = [0] * max_slots
        self.block_tables = torch.zeros(max_slots, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_slots, dtype=torch.int32, device=device)
        self.last_token = torch.zeros(max_slots, dtype=torch.int64, device=device)
        self.device = device

    def write_blocks(self, writes: list[tuple[int, int, list[int]]]) -> None:
        """Apply (slot, first column, block ids) writes to the device block tables in one scatter."""
        rows: list[int] = []
        cols: list[int] = []
        vals: list[int] = []
        for slot, first, ids in writes:
            rows += [slot] * len(ids)
            cols += range(first, first + len(ids))
            vals += ids
        if vals:
            dev = upload([rows, cols, vals], torch.int64, self.device)
            self.block_tables.index_put_((dev[0], dev[1]), dev[2].to(torch.int32))

    def set_lengths(self, slots: list[int], lengths: list[int], last_tokens: list[int] | None = None) -> None:
        """The slots' context lengths and, where given, the tokens they feed next (one upload)."""
        for slot, length in zip(slots, lengths, strict=True):
            self.seq_len[slot] = length
        if slots:
            dev = upload([slots, lengths, *([last_tokens] if last_tokens is not None else [])], torch.int64,
                         self.device)
            self.seq_lens.index_copy_(0, dev[0], dev[1].to(torch.int32))
            if last_tokens is not None:
                self.last_token.index_copy_(0, dev[0], dev[2])

    def release(self, slot: int) -> None:
        self.active[slot] = self.has_token[slot] = False
        self.seq_len[slot] = self.num_blocks[slot] = 0
