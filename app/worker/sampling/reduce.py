"""Row reductions over the vocabulary, in two passes on CUDA.

torch reduces a [B, V] row with few thread blocks per row when B is small: its argmax over 4 rows of
Llama-3's 128,256 logits took 27 us on the H200 and the max 15 us, about 1% of a decode step; the two
passes take 13.5 us together. Viewed as [B, V / piece, piece], the
first pass runs B * V / piece short reductions in parallel and the second reduces the pieces' results.
The values are the one-pass ones: a max is exact in any order, and each pass keeps the first index of
its largest value (torch's argmax rule), so the index is the first too.
"""

from __future__ import annotations

import torch

from app.worker.layers.fused import kernel_module

_MAX_PIECE = 1024
_MIN_PIECE = 64  # a vocabulary with no power-of-two factor this large is reduced in one pass


def piece_width(vocab: int) -> int:
    """The largest power of two that divides the vocabulary, up to 1024; 0 (one pass) below 64."""
    piece = min(vocab & -vocab, _MAX_PIECE)
    return piece if piece >= _MIN_PIECE else 0


def _piece(x: torch.Tensor) -> int:
    """The piece width for these rows: two passes on CUDA only (the CPU's one pass is not slow)."""
    return piece_width(x.shape[-1]) if x.is_cuda and x.dim() == 2 and x.is_contiguous() else 0


def max_rows(x: torch.Tensor) -> torch.Tensor:
    """x.amax(dim=-1) of [B, V] rows (NaN propagates)."""
    piece = _piece(x)
    return max_in_pieces(x, piece) if piece else x.amax(dim=-1)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of [B, V] rows: int64, the first index of the largest value."""
    piece = _piece(x)
    return argmax_in_pieces(x, piece) if piece else x.argmax(dim=-1)


def argmax_and_bad_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax_rows(x), ~isfinite(max_rows(x))): a greedy batch's tokens and its bad rows (NaN, +inf,
    or all -inf). On CUDA one read of x (kernels/greedy.py) instead of the two reductions; on the CPU
    one max(dim) (the first index of the largest value, NaN propagated, as argmax), which over bf16
    logits took half the time of the argmax alone."""
    if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1:
        return kernel_module("greedy").greedy_tokens(x)
    if not x.is_cuda:
        values, tokens = x.max(dim=-1)
        return tokens, ~torch.isfinite(values)
    return argmax_rows(x), ~torch.isfinite(max_rows(x))


def max_in_pieces(x: torch.Tensor, piece: int) -> torch.Tensor:
    return x.view(x.shape[0], -1, piece).amax(dim=-1).amax(dim=-1)


def argmax_in_pieces(x: torch.Tensor, piece: int) -> torch.Tensor:
    values, index = x.view(x.shape[0], -1, piece).max(dim=-1)
    best = values.argmax(dim=-1, keepdim=True)
    return (best * piece + index.gather(1, best)).squeeze(1)
