"""The two-pass vocabulary reductions give torch's one-pass results (tests/gpu checks the CUDA dispatch)."""

from __future__ import annotations

import pytest
import torch

from app.worker.sampling.reduce import (
    argmax_and_bad_rows,
    argmax_in_pieces,
    argmax_rows,
    max_in_pieces,
    max_rows,
    piece_width,
)


def rows_with_ties() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 512, generator=gen).round(decimals=1)  # many equal values
    x[1, [3, 70, 200, 511]] = 9.0  # the largest, tied across pieces: the first wins
    x[2, [130, 131]] = 9.0  # tied inside one piece
    x[3] = -torch.inf  # nothing to choose: index 0, as torch
    x[4, 300] = torch.inf
    x[5, 511] = 9.0  # the last entry
    return x


@pytest.mark.parametrize("piece", [64, 128, 512])
def test_two_passes_equal_one(piece: int) -> None:
    x = rows_with_ties()
    assert torch.equal(argmax_in_pieces(x, piece), x.argmax(dim=-1))
    assert torch.equal(max_in_pieces(x, piece), x.amax(dim=-1))
    assert argmax_in_pieces(x, piece)[1:3].tolist() == [3, 130]


def test_nan_propagates_to_the_max() -> None:
    x = rows_with_ties()
    x[0, 100] = torch.nan
    assert max_in_pieces(x, 64)[0].isnan() and not max_in_pieces(x, 64)[1:].isnan().any()


def test_cpu_rows_take_one_pass() -> None:
    x = rows_with_ties()
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1)) and torch.equal(max_rows(x), x.amax(dim=-1))
    odd = torch.randn(2, 1001)  # no power-of-two factor: one pass on any device
    assert torch.equal(argmax_rows(odd), odd.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_greedy_rows_take_one_max(dtype: torch.dtype) -> None:
    """max(dim) on the CPU: argmax's first index among ties, and the bad rows (NaN, +inf, all -inf)."""
    x = rows_with_ties().to(dtype)
    x[0, 100] = torch.nan
    tokens, bad = argmax_and_bad_rows(x)
    assert torch.equal(tokens, x.argmax(dim=-1)) and tokens[1:3].tolist() == [3, 130]
    assert bad.tolist() == [True, False, False, True, True, False]


def test_piece_widths() -> None:
    """Llama-3's vocabulary splits into 256-wide pieces, Qwen's into 128; an odd one takes one pass."""
    assert [piece_width(v) for v in (128_256, 151_936, 1 << 20, 1001, 32_000)] == [256, 128, 1024, 0, 256]
