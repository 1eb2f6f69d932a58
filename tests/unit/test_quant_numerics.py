"""FP8 numerics against float64 references: round trips within the e4m3 bound, block scales, and the
scaled GEMM (emulated, and torch._scaled_mm where this torch runs it on the CPU).

Bounds (docs/quantization.md): one e4m3 rounding is within REL_ERROR = 2^-4 of |v| in the normal
range and SUBNORMAL_ERROR = 2^-10 of the scale below it. For a product of two rounded operands,
|x'w' - xw| <= ex|w| + |x|ew + ex ew elementwise, with ex, ew those per-element bounds; summed over K
that is the GEMM bound checked here (plus float32 accumulation slack).
"""

from __future__ import annotations

import pytest
import torch

from app.worker.quantization import fp8_linear, gemm_backend, quantize, quantize_rows
from app.worker.quantization.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    REL_ERROR,
    SUBNORMAL_ERROR,
    expand_block_scales,
    requantize_blocks_to_rows,
)
from app.worker.quantization.gemm import EMULATED, GEMV_MAX_ROWS, SCALED_MM_ROWWISE, SCALED_MM_TENSORWISE


def _bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element round-trip error bound for values x quantized with (broadcast) scale."""
    return torch.maximum(REL_ERROR * x.abs(), SUBNORMAL_ERROR * scale)


def _wide_range(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Values over several orders of magnitude, an outlier per row, and one all-zero row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * torch.logspace(-3, 2, rows).unsqueeze(1)
    x[:, 0] *= 30
    x[1] = 0
    return x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_row_round_trip_is_within_the_e4m3_bound(seed: int) -> None:
    x = _wide_range(16, 96, seed)
    codes, scales = quantize_rows(x)
    assert codes.dtype == FP8_DTYPE and scales.shape == (16, 1) and scales.dtype == torch.float32
    back = codes.double() * scales.double()
    assert bool(((back - x).abs() <= _bound(x, scales.double()) * (1 + 1e-6)).all())
    assert bool((codes.float().abs().amax(dim=1)[x.abs().amax(dim=1) > 0] == FP8_MAX).all())  # range used
    assert bool((back[1] == 0).all())  # an all-zero row stays zero, no NaN


def test_static_scale_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([1000.0, -1000.0, 447.0, 0.5, -1e-9])
    back = quantize(x, torch.tensor(1.0)).float()
    assert back.tolist()[:2] == [FP8_MAX, -FP8_MAX] and not bool(back.isnan().any())
    assert quantize(x, 4.0).float()[0] == 256.0  # 1000 / 4 = 250: the grid step in [128, 256) is 16


def test_block_scales_expand_over_partial_tiles() -> None:
    tiles = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    full = expand_block_scales(tiles, 5, 3, (4, 2))
    assert full.tolist() == [[1, 1, 2]] * 4 + [[3, 3, 4]]


@pytest.mark.parametrize("shape", [(256, 384), (200, 130)])
def test_block_to_row_requantization_stays_within_one_more_rounding(shape: tuple[int, int]) -> None:
    rows, cols = shape
    w = _wide_range(rows, cols, 3)
    block = (128, 128)
    tiles_shape = (-(-rows // 128), -(-cols // 128))
    gen = torch.Generator().manual_seed(4)
    tile_scales = torch.rand(tiles_shape, generator=gen, dtype=torch.float64) + 0.05
    full = expand_block_scales(tile_scales, rows, cols, block).double()
    codes = quantize(w, full)
    block_values = codes.double() * full  # what the checkpoint means
    new_codes, row_scales = requantize_blocks_to_rows(codes, tile_scales.float(), block, chunk_rows=128)
    back = new_codes.double() * row_scales.double()
    assert bool(((back - block_values).abs() <= _bound(block_values, row_scales.double()) * (1 + 1e-6)).all())


def _gemm_bound(
    x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    ex, ew = _bound(x, x_scale), _bound(w, w_scale)
    return ex @ w.abs().T + x.abs() @ ew.T + ex @ ew.T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emulated_gemm_against_float64(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 64, generator=gen, dtype=torch.float64)
    w = torch.randn(48, 64, generator=gen, dtype=torch.float64) * torch.logspace(-2, 1, 48).unsqueeze(1)
    bias = torch.randn(48, generator=gen, dtype=torch.float64)
    w_codes, w_scale = quantize_rows(w)
    y = fp8_linear(x.to(dtype), w_codes, w_scale.view(1, -1), None, bias.to(dtype), EMULATED)
    assert y.dtype == dtype and y.shape == (7, 48)
    # 1) The GEMM of the rounded operands, exactly (up to the output dtype's rounding).
    x_codes, x_scale = quantize_rows(x.to(dtype))
    exact = (x_codes.double() * x_scale.double()) @ (w_codes.double() * w_scale.double()).T + bias.to(
        dtype
    ).double()
    out_eps = 1e-5 if dtype == torch.float32 else 2.0**-7
    assert bool(((y.double() - exact).abs() <= out_eps * (exact.abs() + 1)).all())
    # 2) Against the unrounded operands, within the documented product bound.
    reference = x @ w.T + bias
    bound = _gemm_bound(x.to(dtype).double(), w, x_scale.double(), w_scale.double())
    slack = 1e-5 if dtype == torch.float32 else 2.0**-7 * reference.abs() + 2.0**-7
    assert bool(((y.double() - reference).abs() <= bound + slack).all())


def test_static_input_scale_is_used_as_given() -> None:
    x = torch.tensor([[1.0, -2.0, 3.0, 0.25]])
    w_codes, w_scale = quantize_rows(torch.eye(4))
    y = fp8_linear(x, w_codes, w_scale.view(1, -1), torch.tensor(0.5), None, EMULATED)
    assert torch.allclose(y, x, rtol=1e-6, atol=0)  # all on the grid of scale 0.5
    # x * 100 / 0.5 = [200, -400, 600, 50]: ties round to even (192, -384), 600 saturates at 448, 50 -> 48.
    rounded = fp8_linear(x * 100, w_codes, w_scale.view(1, -1), torch.tensor(0.5), None, EMULATED)
    assert torch.allclose(rounded, torch.tensor([[96.0, -192.0, 224.0, 24.0]]), rtol=1e-6, atol=0)


def _cpu_scaled_mm() -> bool:
    a = torch.zeros(16, 16).to(FP8_DTYPE)
    try:
        torch._scaled_mm(
            a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16
        )
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


@pytest.mark.skipif(not _cpu_scaled_mm(), reason="this torch has no CPU torch._scaled_mm")
@pytest.mark.parametrize("backend", [SCALED_MM_ROWWISE, SCALED_MM_TENSORWISE])
def test_scaled_mm_call_layout_matches_the_emulated_gemm(backend: str) -> None:
    """The Hopper/Ada call shapes (column-major weight view, [M,1] x [1,N] scales) run here on the CPU;
    more rows than the decode-sized GEMV takes (kernels/gemv.py), so _scaled_mm is what runs."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(GEMV_MAX_ROWS + 3, 64, generator=gen, dtype=torch.bfloat16)
    w_codes, w_scale = quantize_rows(torch.randn(32, 64, generator=gen))
    args = (x, w_codes, w_scale.view(1, -1), None, None)
    got, want = fp8_linear(*args, backend).float(), fp8_linear(*args, EMULATED).float()
    assert torch.allclose(got, want, rtol=2**-7, atol=1e-2)


def test_gemm_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gemm_backend(torch.device("cpu"), 64, 64) == EMULATED
    cuda = torch.device("cuda", 0)
    for capability, expected in [
        ((9, 0), SCALED_MM_ROWWISE),
        ((8, 9), SCALED_MM_TENSORWISE),
        ((8, 0), EMULATED),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device, c=capability: c)
        assert gemm_backend(cuda, 4096, 1024) == expected
    assert gemm_backend(cuda, 4096, 1000) == EMULATED  # _scaled_mm needs dims that are multiples of 16
    assert gemm_backend(cuda, 72, 1024) == EMULATED
