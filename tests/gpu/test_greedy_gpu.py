"""The greedy reduction (kernels/greedy.py) on the GPU compiler's code, Llama-3's vocabulary in bf16:
torch's argmax and bad-row verdict, from one row (many pieces a row) to 512 (one)."""

from __future__ import annotations

import pytest
import torch

from app.worker.sampling.processors import find_bad_rows
from app.worker.sampling.reduce import argmax_and_bad_rows, argmax_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("rows", [1, 4, 33, 512])
def test_greedy_tokens_are_torchs(rows: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, 128256, device="cuda", generator=gen) * 4).bfloat16()  # bf16: many ties
    if rows > 3:
        x[1, :] = float("-inf")
        x[2, 100_000] = float("nan")
        x[3, [5, 70_000]] = 1e4  # a tie across pieces: the first
    tokens, bad = argmax_and_bad_rows(x)
    want_bad = find_bad_rows(x)
    assert torch.equal(bad, want_bad)
    assert torch.equal(tokens[~want_bad], argmax_rows(x)[~want_bad])
    assert torch.equal(tokens[~want_bad], x.float().argmax(dim=-1)[~want_bad])
