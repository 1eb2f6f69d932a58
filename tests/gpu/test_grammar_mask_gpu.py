"""The grammar bitmask apply (kernels/grammar_mask.py) on the GPU compiler's code, Llama-3's vocabulary:
its torch reference, with compacted bitmask rows, float32 and bf16 logits, and logits wider than the mask."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked_rows", [1, 64])
def test_apply_is_the_reference(dtype: torch.dtype, masked_rows: int) -> None:
    from tokenspeed_kernels.grammar_mask import apply_bitmask, apply_bitmask_reference

    gen = torch.Generator(device="cuda").manual_seed(masked_rows)
    vocab, width = 128_000, 128_256  # the bitmask covers fewer ids than the logits row
    logits = torch.randn(96, width, device="cuda", generator=gen).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (masked_rows, (vocab + 31) // 32), dtype=torch.int32,
                            device="cuda", generator=gen)
    rows = torch.randperm(96, device="cuda", generator=gen)[:masked_rows].to(torch.int32)
    ours, reference = logits.clone(), logits.clone()
    apply_bitmask(ours, bitmask, rows)
    apply_bitmask_reference(reference, bitmask, rows)
    assert torch.equal(ours, reference)
