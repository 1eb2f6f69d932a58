"""The greedy reduction (kernels/greedy.py) under the interpreter: torch's argmax (first index of the
largest value) and find_bad_rows' verdict, over rows cut into several pieces of several blocks."""

from __future__ import annotations

import pytest
import torch
from tokenspeed_kernels import greedy

VOCAB = 150


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(greedy, "BLOCK", 16)  # 150 logits: up to 10 blocks, in several pieces


def logit_rows(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, VOCAB, generator=gen) * 3
    x[1, [3, 40, 120]] = 50.0  # ties: the first index wins, across pieces
    x[2, [40, 149]] = 50.0  # the largest value first in a later piece, tied in the last lane
    x[3, :] = float("-inf")  # nothing can be sampled: bad
    x[4, 77] = float("nan")  # bad
    x[5, 12] = float("inf")  # bad
    x[6, :100] = float("-inf")  # partly masked: fine
    x[7, :] = 0.0  # all equal: index 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("max_pieces", [3, 64])  # 3: pieces of 4 blocks; 64: a block a piece
def test_tokens_and_bad_rows_are_torchs(
    dtype: torch.dtype, rows: int, max_pieces: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(greedy, "MAX_PIECES", max_pieces)
    x = logit_rows(dtype)[:rows]
    tokens, bad = greedy.greedy_tokens(x)
    want_tokens, want_bad = greedy.greedy_tokens_reference(x)
    assert tokens.dtype == torch.int64 and bad.dtype == torch.bool
    assert bad.tolist() == want_bad.tolist()
    good = ~want_bad
    assert tokens[good].tolist() == want_tokens[good].tolist()
    assert greedy.pieces_for(rows, VOCAB) > 1  # the pieces are combined


def test_empty_batch_and_bad_layouts() -> None:
    tokens, bad = greedy.greedy_tokens(torch.zeros(0, VOCAB))
    assert tokens.shape == (0,) and bad.shape == (0,)
    with pytest.raises(ValueError, match="contiguous"):
        greedy.greedy_tokens(torch.zeros(VOCAB, 4).t())
