"""Apply a compacted grammar bitmask to chosen logits rows, in one launch.

bitmask[i] (XGrammar's layout: 32 tokens per int32, lowest bit first) is the mask of logits row rows[i];
every token whose bit is 0, and every id at or past the bitmask's width, becomes -inf. Only masked
positions are written, so a mostly-allowed row costs little more than reading its bitmask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _apply_kernel(logits_ptr, bitmask_ptr, rows_ptr, width, logits_stride, bitmask_stride, bitmask_words,
                  BLOCK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + i).to(tl.int64)
    word = offs // 32
    words = tl.load(bitmask_ptr + i * bitmask_stride + word, mask=(offs < width) & (word < bitmask_words), other=0)
    allowed = (words >> (offs % 32)) & 1
    tl.store(logits_ptr + row * logits_stride + offs, float("-inf"), mask=(offs < width) & (allowed == 0))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits [B, V] (rows contiguous), bitmask [n, words] int32, rows [n] int on the logits' device."""
    if bitmask.dtype != torch.int32 or logits.stride(1) != 1:
        raise ValueError("apply_bitmask needs an int32 bitmask and logits rows contiguous")
    count, width = rows.shape[0], logits.shape[1]
    if count == 0:
        return
    bitmask = bitmask.contiguous()
    grid = (count, triton.cdiv(width, BLOCK))
    _apply_kernel[grid](logits, bitmask, rows, width, logits.stride(0), bitmask.stride(0), bitmask.shape[1],
                        BLOCK=BLOCK)


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    width = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :width]
    if allowed.shape[1] < width:
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]), value=False)
    for i, row in enumerate(rows.tolist()):
        logits[row].masked_fill_(~allowed[i], float("-inf"))
