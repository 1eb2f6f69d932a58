"""The fused W8A8 GEMVs (kernels/gemv_fused.py) under the interpreter, against the unfused kernels they replace
run one after another (rms_norm_fp8 or quantize_rows, then gemv; silu_and_mul_fp8; the residual add), and
against torch's float64 product of the same codes.

The interpreter sums the norm's squares in one order whatever the layout, so here the fused kernel gives the
unfused kernels' numbers bit for bit; on the GPU the order may differ (tests/gpu/test_fp8_gpu.py compares
within a tolerance there). float16 activations: the interpreter's bfloat16 arithmetic is wrong.
"""

from __future__ import annotations

import pytest
import torch
from tokenspeed_kernels import gemv_fused
from tokenspeed_kernels.activation import silu_and_mul_fp8
from tokenspeed_kernels.common import arrival_counts
from tokenspeed_kernels.fp8_quant import quantize_rows, quantize_rows_with_amax
from tokenspeed_kernels.gemv import GemvConfig, gemv, gemv_reference
from tokenspeed_kernels.gemv_fused import gemv_add, norm_gemv
from tokenspeed_kernels.rmsnorm import rms_norm_fp8

from app.worker.quantization.fp8 import quantize_rows as torch_quantize_rows

EPS = 1e-5
DTYPE = torch.float16
SPLIT2 = GemvConfig(True, 16, 32, 2, w_as_a=True, fp8_operands=True)
CONFIGS = {
    "default": None,
    "split 2, weight as operand A": SPLIT2,
    "split 3, x as operand A": GemvConfig(True, 16, 32, 3, fp8_operands=True),
}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = torch_quantize_rows(torch.randn(n, k, generator=gen(seed)) * 0.05)
    return codes, scales.view(-1)


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    return (torch.randn(m, k, generator=gen(seed)) * torch.logspace(-1, 1, m).view(m, 1)).to(DTYPE)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("m,n,k", [(1, 48, 96), (3, 40, 72), (16, 32, 64)])
@pytest.mark.parametrize("config", CONFIGS)
def test_norm_gemv_is_the_norm_then_the_gemv(m: int, n: int, k: int, config: str) -> None:
    x, norm_weight = activations(m, k, 1), (torch.rand(k, generator=gen(2)) + 0.5).to(DTYPE)
    weight, scale = fp8_weight(n, k, 3)
    got = norm_gemv(x, norm_weight, EPS, weight, scale, config=CONFIGS[config])
    codes, x_scales = rms_norm_fp8(x, norm_weight, EPS)
    assert_same(got, gemv(codes, weight, scale, CONFIGS[config], x_scales, DTYPE))
    reference = gemv_reference(codes, weight, scale, x_scales, torch.float64)
    assert torch.allclose(got.double(), reference, rtol=2e-3, atol=2e-3 * reference.abs().max().item())


@pytest.mark.parametrize("m,i,k", [(1, 40, 64), (2, 48, 96)])
def test_gated_norm_gemv_is_gate_up_then_silu_and_its_quantization(m: int, i: int, k: int) -> None:
    x, norm_weight = activations(m, k, 4), (torch.rand(k, generator=gen(5)) + 0.5).to(DTYPE)
    weight, scale = fp8_weight(2 * i, k, 6)
    config = GemvConfig(True, 16, 32, 1, w_as_a=True, fp8_operands=True)
    products, parts = norm_gemv(x, norm_weight, EPS, weight, scale, gated=True, config=config)
    codes, x_scales = rms_norm_fp8(x, norm_weight, EPS)
    gate_up = gemv(codes, weight, scale, config, x_scales, DTYPE)
    want_codes, want_scales = silu_and_mul_fp8(gate_up)
    assert parts.shape == (m, -(-i // 16))
    got_codes, got_scales = quantize_rows_with_amax(products, parts, 16)
    assert torch.equal(got_codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(got_scales, want_scales)


@pytest.mark.parametrize("m,n,k", [(1, 48, 96), (4, 40, 72)])
@pytest.mark.parametrize("config", CONFIGS)
def test_gemv_add_quantizes_x_and_adds_the_product_to_the_residual(m: int, n: int, k: int, config: str) -> None:
    x, residual = activations(m, k, 7), activations(m, n, 8)
    weight, scale = fp8_weight(n, k, 9)
    codes, x_scales = quantize_rows(x)
    want = (gemv(codes, weight, scale, CONFIGS[config], x_scales, DTYPE) + residual).to(DTYPE)
    got = gemv_add(x, weight, scale, residual, config=CONFIGS[config])
    assert got is residual
    assert_same(got, want)
    assert not arrival_counts(x.device, 1).any()  # the splits' counts left at zero


@pytest.mark.parametrize("config", CONFIGS)
def test_gemv_add_takes_the_rows_amax_from_partial_maxima(config: str) -> None:
    """down after gated gate_up: the scale from the largest partial maximum, not from x."""
    m, n, k = 2, 40, 80
    x, residual = activations(m, k, 10), activations(m, n, 11)
    weight, scale = fp8_weight(n, k, 12)
    parts = torch.rand(m, 5, generator=gen(13)) * x.float().abs().amax(dim=1, keepdim=True)
    parts[:, 3] = 2 * x.float().abs().amax(dim=1)  # larger than x's own amax: the scale must follow it
    codes, x_scales = quantize_rows_with_amax(x, parts, 16)
    want = (gemv(codes, weight, scale, CONFIGS[config], x_scales, DTYPE) + residual).to(DTYPE)
    assert_same(gemv_add(x, weight, scale, residual, parts, CONFIGS[config]), want)


def test_the_fused_gemv_refuses_what_it_does_not_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    x = activations(1, 64, 14)
    weight, scale = fp8_weight(32, 64, 15)
    norm_weight = torch.ones(64, dtype=DTYPE)
    with pytest.raises(ValueError, match="no split along K"):
        norm_gemv(x, norm_weight, EPS, weight, scale, gated=True, config=SPLIT2)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        norm_gemv(x.float(), norm_weight, EPS, weight, scale)
    with pytest.raises(ValueError, match="FP8 codes"):
        norm_gemv(x, norm_weight, EPS, weight.to(DTYPE), scale)
    with pytest.raises(ValueError, match="the residual"):
        gemv_add(x, weight, scale, torch.zeros(1, 16, dtype=DTYPE))
    with pytest.raises(ValueError, match="partial maxima"):
        gemv_add(x, weight, scale, torch.zeros(1, 32, dtype=DTYPE), torch.zeros(2, 4))
    monkeypatch.setattr(gemv_fused, "MAX_ROW", 32)
    with pytest.raises(ValueError, match="up to 32 elements"):
        gemv_add(x, weight, scale, torch.zeros(1, 32, dtype=DTYPE))
