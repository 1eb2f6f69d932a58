"""The grammar bitmask apply (kernels/grammar_mask.py) under the interpreter: XGrammar's own apply, with
a compacted bitmask (row i masks logits row rows[i]), logits wider than the bitmask, and untouched rows."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr
from tokenspeed_kernels import grammar_mask

VOCAB = 150  # 5 words of 32 bits: the last partly used


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammar_mask, "BLOCK", 64)  # several blocks a row, the last partial


@pytest.mark.parametrize("width", [VOCAB, VOCAB + 30])  # + 30: logits wider than the bitmask's 160 bits
def test_apply_equals_xgrammar_and_the_reference(width: int) -> None:
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (VOCAB + 31) // 32), dtype=torch.int32, generator=gen)
    logits = torch.randn(5, width, generator=gen)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32)
    ours, reference = logits.clone(), logits.clone()
    grammar_mask.apply_bitmask(ours, bitmask, rows)
    grammar_mask.apply_bitmask_reference(reference, bitmask, rows)
    assert torch.equal(ours, reference)
    theirs = logits.clone()
    full = torch.full((5, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows.long()] = bitmask
    bits = 32 * bitmask.shape[1]
    xgr.apply_token_bitmask_inplace(theirs, full, vocab_size=min(width, bits), indices=rows.tolist())
    theirs[rows.long(), bits:] = float("-inf")  # ids past the bitmask are never allowed
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])  # rows not named are untouched
    assert torch.isinf(ours[rows.long()]).any()


def test_no_rows_and_bad_layouts() -> None:
    logits = torch.randn(2, VOCAB)
    grammar_mask.apply_bitmask(logits, torch.zeros(0, 5, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        grammar_mask.apply_bitmask(logits, torch.zeros(1, 5, dtype=torch.int64), torch.zeros(1, dtype=torch.int32))
