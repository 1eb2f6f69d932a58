"""The FP8-weight GEMV (kernels/fp8_gemv.py) under the interpreter against a float64 reference.

Codes and scales are read exactly, so what differs is the kernel's arithmetic: float32 activations
accumulate in float32 (REL_TOL 1e-5 relative L2); float16 ones are multiplied as float16 on the tensor
cores' path with float32 accumulation, and the output rounds to float16 (2e-3). Shapes are not multiples
of the tiles, so every mask is exercised. bfloat16 runs on the GPU only (the interpreter has no bf16 dot).
"""

from __future__ import annotations

import pytest
import torch
from tokenspeed_kernels.fp8_gemv import MAX_M, fp8_gemv, fp8_gemv_reference

from app.worker.quantization import fp8_linear
from app.worker.quantization.fp8 import quantize_rows
from app.worker.quantization.gemm import SCALED_MM_ROWWISE, SCALED_MM_TENSORWISE

REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes, scales = quantize_rows(torch.randn(n, k, generator=gen) * 0.05)
    return codes, scales.view(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (3, 64, 128), (16, 24, 200)])
def test_fp8_gemv_matches_float64(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    weight, scale = fp8_weight(n, k, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    got, want = fp8_gemv(x, weight, scale), fp8_gemv_reference(x, weight, scale)
    assert got.dtype == dtype and got.shape == (m, n)
    err = (got.double() - want.double()).norm() / want.double().norm()
    assert err < REL_TOL[dtype], err


def test_fp8_gemv_refuses_what_it_does_not_serve() -> None:
    weight, scale = fp8_weight(16, 32, seed=0)
    with pytest.raises(ValueError, match=f"up to {MAX_M} rows"):
        fp8_gemv(torch.randn(MAX_M + 1, 32), weight, scale)
    with pytest.raises(ValueError, match="weight and N scales"):
        fp8_gemv(torch.randn(2, 32), weight.float(), scale)


@pytest.mark.parametrize("backend", [SCALED_MM_ROWWISE, SCALED_MM_TENSORWISE])
def test_decode_sized_batches_take_the_weight_only_gemv(backend: str) -> None:
    """Up to GEMV_MAX_ROWS rows the FP8-capable backends multiply unquantized activations by the FP8
    weights (W8A16): the float64 product of x and the dequantized weights, rounded once."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 64, generator=gen).to(torch.float16)
    w_codes, w_scale = quantize_rows(torch.randn(32, 64, generator=gen))
    bias = torch.randn(32, generator=gen).to(torch.float16)
    got = fp8_linear(x, w_codes, w_scale.view(1, -1), None, bias, backend)
    want = fp8_gemv_reference(x, w_codes, w_scale.view(-1)) + bias
    assert torch.allclose(got.float(), want.float(), rtol=2**-9, atol=2e-3)
