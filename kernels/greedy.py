"""Greedy sampling's reduction over the vocabulary in one read of the logits: each row's argmax (the first
index of its largest value, torch's rule) and whether the row is bad (a NaN or +inf, or nothing but
-inf: what app/worker/sampling/processors.find_bad_rows reports; a bad row's token is meaningless).

torch needs two reductions for that (a max for the bad rows, an argmax), each read of a [B, V] bfloat16
batch at ~a quarter of the copy bandwidth on the H200 (512 rows of Llama-3's 128,256 logits: 142 and
106 us of a 22 ms decode step). Here each row is cut into pieces so that a few rows still fill the GPU:
program (row, piece) keeps a running best value and index per lane over its piece (a strictly larger
value replaces the lane's, so each lane keeps its first best) and reduces them once at the end; a
second kernel combines a row's pieces in order (the first piece holding the largest value wins).
Neither kernel is specialized on the piece sizes, which follow the batch's row count: a mixed step
would otherwise meet a new variant now and then and wait tens of milliseconds for its module to load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
MIN_PROGRAMS = 264  # two per SM of an H200: rows x pieces
MAX_PIECES = 64


@triton.jit(do_not_specialize=["PIECE", "PIECES"])
def _piece_kernel(x_ptr, val_ptr, idx_ptr, nan_ptr, V, stride_x, PIECE, PIECES, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    nan = tl.zeros([BLOCK], dtype=tl.int1)
    start = piece * PIECE
    end = tl.minimum(start + PIECE, V)
    for first in range(start, end, BLOCK):
        idx = first + lanes
        x = tl.load(x_ptr + row * stride_x + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
        better = x > best  # False for NaN: tracked apart
        best = tl.where(better, x, best)
        best_idx = tl.where(better, idx, best_idx)
        nan = nan | (x != x)
    value = tl.max(best, axis=0)
    first_best = tl.min(tl.where(best == value, best_idx, 2147483647), axis=0)
    out = row * PIECES + piece
    tl.store(val_ptr + out, value)
    tl.store(idx_ptr + out, tl.where(value == float("-inf"), start, first_best))
    tl.store(nan_ptr + out, tl.max(nan.to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["PIECES"])
def _combine_kernel(val_ptr, idx_ptr, nan_ptr, token_ptr, bad_ptr, PIECES, BLOCK_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    ok = p < PIECES
    vals = tl.load(val_ptr + row * PIECES + p, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + row * PIECES + p, mask=ok, other=2147483647)
    nan = tl.load(nan_ptr + row * PIECES + p, mask=ok, other=0)
    value = tl.max(vals, axis=0)
    first_piece = tl.min(tl.where(vals == value, p, BLOCK_P), axis=0)
    token = tl.sum(tl.where(p == first_piece, idx, 0), axis=0)
    bad = (tl.max(nan, axis=0) > 0) | (value == float("inf")) | (value == float("-inf"))
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(bad_ptr + row, bad)


def pieces_for(rows: int, vocab: int) -> int:
    """How many pieces a row is cut into: enough programs for the GPU, none shorter than a block."""
    wanted = min(MAX_PIECES, triton.cdiv(MIN_PROGRAMS, max(rows, 1)))
    return max(1, min(wanted, triton.cdiv(vocab, BLOCK)))


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (rows contiguous) -> (argmax [B] int64, bad [B] bool)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"greedy_tokens takes [B, V] rows contiguous in V, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    bad = torch.empty(rows, dtype=torch.bool, device=logits.device)
    if rows == 0:
        return tokens, bad
    pieces = pieces_for(rows, vocab)
    piece = triton.cdiv(triton.cdiv(vocab, pieces), BLOCK) * BLOCK  # pieces start on block boundaries
    pieces = triton.cdiv(vocab, piece)
    vals = torch.empty(rows, pieces, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, pieces, dtype=torch.int32, device=logits.device)
    nan = torch.empty(rows, pieces, dtype=torch.int32, device=logits.device)
    _piece_kernel[(rows, pieces)](logits, vals, idx, nan, vocab, logits.stride(0), piece, pieces, BLOCK=BLOCK,
                                  num_warps=8)  # fmt: skip
    _combine_kernel[(rows,)](vals, idx, nan, tokens, bad, pieces, BLOCK_P=triton.next_power_of_2(MAX_PIECES))
    return tokens, bad


def greedy_tokens_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.argmax(dim=-1), ~torch.isfinite(logits.amax(dim=-1))
