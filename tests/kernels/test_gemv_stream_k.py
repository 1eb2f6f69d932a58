"""The stream-K decode GEMV (kernels/gemv_stream_k.py) under the interpreter against a float64 reference.

Program counts are chosen so that N blocks are held whole by one program, shared by two, and shared by
more than two (runs shorter than an N block's K chunks), with ragged N and K (every mask). float16 x and
weights (the interpreter has no bfloat16 dot), and W8A8 (FP8 codes times FP8 codes, exact products).
"""

from __future__ import annotations

import pytest
import torch
from tokenspeed_kernels.common import arrival_counts
from tokenspeed_kernels.gemv import gemv_reference
from tokenspeed_kernels.gemv_stream_k import StreamKConfig, gemv_stream_k, most_sharers

from app.worker.quantization.fp8 import quantize_rows
from tests.support.numerics import relative_error

SHAPES = [(1, 40, 96), (3, 33, 200), (16, 24, 130)]
PROGRAMS = [1, 2, 5, 13]


def operands(m: int, n: int, k: int, fp8: bool) -> dict:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    if not fp8:
        return {"x": x.half(), "weight": w.half()}
    (x_codes, x_scale), (w_codes, w_scale) = quantize_rows(x), quantize_rows(w)
    return {"x": x_codes, "x_scale": x_scale, "weight": w_codes, "scale": w_scale.view(-1),
            "out_dtype": torch.float32}  # fmt: skip


@pytest.mark.parametrize("fp8", [False, True], ids=["fp16", "w8a8"])
@pytest.mark.parametrize("programs", PROGRAMS)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_stream_k_matches_float64(m: int, n: int, k: int, programs: int, fp8: bool) -> None:
    args = operands(m, n, k, fp8)
    cfg = StreamKConfig(block_n=16, block_k=32, programs=programs, w_as_a=False)
    got = gemv_stream_k(config=cfg, **args)
    want = gemv_reference(**args)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert relative_error(got.double(), want.double()) < (1e-5 if fp8 else 2e-3)
    assert not arrival_counts(got.device, 1).any()  # every shared N block's count back at zero


def test_the_programs_share_n_blocks_as_the_tests_mean() -> None:
    """The shapes and program counts above cover N blocks held whole, shared by two and by more."""
    seen = set()
    for _, n, k in SHAPES:
        n_blocks, k_chunks = -(-n // 16), -(-k // 32)
        for programs in PROGRAMS:
            seen.add(min(most_sharers(n_blocks, k_chunks, min(programs, n_blocks * k_chunks)), 3))
    assert seen == {1, 2, 3}


def test_stream_k_weight_as_operand_a_matches_the_plain_layout() -> None:
    args = operands(3, 33, 200, fp8=True)
    plain = gemv_stream_k(config=StreamKConfig(16, 32, 5, w_as_a=False), **args)
    as_a = gemv_stream_k(config=StreamKConfig(16, 32, 5, w_as_a=True), **args)
    assert relative_error(as_a.double(), plain.double()) < 1e-6


def test_stream_k_refuses_mixed_operands() -> None:
    args = operands(1, 40, 96, fp8=True)
    with pytest.raises(ValueError, match="16-bit x with 16-bit weights or FP8 with FP8"):
        gemv_stream_k(torch.randn(1, 96).half(), args["weight"], StreamKConfig(16, 32, 2), args["scale"])
