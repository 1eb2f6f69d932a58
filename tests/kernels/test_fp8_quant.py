"""Per-row FP8 quantization (kernels/fp8_quant.py) under the interpreter: the same codes, bit for bit,
and the same scales as the torch path the CPU runs (app/worker/quantization/fp8.py). Rows longer than
the kernel's block, an all-zero row and rows spanning many binades (subnormal codes) included. bf16
runs on the GPU only (tests/gpu/test_fp8_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from tokenspeed_kernels.fp8_quant import cast_to_e4m3, quantize_rows, quantize_rows_reference

from app.worker.quantization.fp8 import quantize
from app.worker.quantization.fp8 import quantize_rows as torch_quantize_rows


def rows(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(m * k)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m).view(m, 1)
    x[0] = 0.0  # all zero: the minimum amax gives it a scale
    if k > 3:
        x[-1, :3] = torch.tensor([1e4, -1e-3, 2.5e-2])  # one large value: the rest land on subnormal codes
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "k"), [(2, 7), (5, 1000), (4, 2500)])
def test_codes_and_scales_equal_the_torch_path(m: int, k: int, dtype: torch.dtype) -> None:
    x = rows(m, k, dtype)
    codes, scales = quantize_rows(x)
    want_codes, want_scales = torch_quantize_rows(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (m, k) and scales.shape == (m, 1)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    ref_codes, ref_scales = quantize_rows_reference(x)
    assert torch.equal(ref_codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(ref_scales, want_scales)
    assert (codes.view(torch.uint8) != 0).any()


def test_strided_rows_and_bad_shapes() -> None:
    wide = rows(3, 64, torch.float32)
    codes, scales = quantize_rows(wide[:, :40])  # rows 64 apart in memory
    want_codes, want_scales = torch_quantize_rows(wide[:, :40])
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scales, want_scales)
    assert quantize_rows(torch.zeros(0, 8))[0].shape == (0, 8)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        quantize_rows(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="contiguous"):
        quantize_rows(wide.t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cast_to_e4m3_gives_the_codes_at_scale_one(dtype: torch.dtype) -> None:
    """The FP8 queries of flashinfer's FA3 prefill: torch's quantize(x, 1.0) codes, bit for bit, from
    strided rows of a fused QKV output, values past +-448 saturated (the bare cast would give NaN), and
    rows wider than a program (3 x 520 = 1560 elements)."""
    gen = torch.Generator().manual_seed(3)
    qkv = (torch.randn(5, 5 * 520, generator=gen) * torch.logspace(-4, 3, 5).view(5, 1)).to(dtype)
    qkv[1, :3] = torch.tensor([1e4, -600.0, 447.0]).to(dtype)
    q = qkv[:, : 3 * 520].view(5, 3, 520)  # rows 2600 apart
    codes = cast_to_e4m3(q)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (5, 3, 520) and codes.is_contiguous()
    assert torch.equal(codes.view(torch.uint8), quantize(q, 1.0).view(torch.uint8))
    assert codes[1, 0, :3].float().tolist() == [448.0, -448.0, 448.0]
    assert cast_to_e4m3(torch.zeros(0, 3, 8)).shape == (0, 3, 8)
    with pytest.raises(ValueError, match="contiguous"):
        cast_to_e4m3(torch.zeros(2, 8, 3).transpose(1, 2))
