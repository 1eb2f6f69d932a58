"""The FP8 GEMM: y = (x quantized per token or per tensor) @ (FP8 weight with per-channel scales)^T.

Two implementations of the same numbers:
- SCALED_MM_*: `torch._scaled_mm` on CUDA GPUs with FP8 tensor cores (compute capability >= 8.9).
  SM90+ (Hopper) uses row-wise scales: scale_a [M, 1] per token, scale_b [1, N] per output channel,
  bf16 output (the only row-wise output type), and fast accumulation: partial sums stay in the tensor
  cores' accumulator instead of being promoted to float32 every few steps, as vLLM's CUTLASS FP8
  kernels for Hopper do. On the H200 that made a decode step's GEMMs 7 to 8% faster (offline
  1000 x 1000 +1%) for a relative error of 2-3e-3 against 1.7e-3; the e4m3
  rounding of the operands dominates either way. SM89 (Ada) has per-tensor scaling only: unit scales,
  a float32 product of the codes, then the same [M, 1] x [1, N] scales. _scaled_mm wants the second
  operand column-major: the [N, K] row-major weight transposed is exactly that, without a copy;
  K and N must be multiples of 16 (layers that are not fall back to EMULATED).
  Decode-sized batches (<= GEMV_MAX_ROWS rows) are bound by reading the weights, and cuBLAS's FP8
  GEMM is slow there: they run kernels/gemv.py instead, which streams the codes once and multiplies
  them by the activations' codes on the FP8 tensor cores (the same W8A8 numbers as the larger batches).
- EMULATED: anywhere else (CPU, older GPUs): the codes cast to the activation dtype (exact: every
  e4m3 value is a bf16/fp16/fp32 value), one matmul, the scales applied in float32. The activations
  go through the same FP8 rounding, so CPU tests see the numerics the GPU runs.
"""

from __future__ import annotations

import torch

from app.worker.layers.fused import kernel_module
from app.worker.layers.linear import GEMV_MAX_M
from app.worker.quantization.fp8 import FP8_DTYPE, Fp8Rows, quantize, quantize_rows

SCALED_MM_ROWWISE = "scaled_mm_rowwise"  # SM90+
SCALED_MM_TENSORWISE = "scaled_mm_tensorwise"  # SM89
EMULATED = "emulated"
BACKENDS = (SCALED_MM_ROWWISE, SCALED_MM_TENSORWISE, EMULATED)
# Up to this many rows the _scaled_mm backends run the FP8 GEMV instead (kernels/gemv.py).
GEMV_MAX_ROWS = GEMV_MAX_M


def gemm_backend(device: torch.device, in_features: int, out_features: int) -> str:
    """The implementation a layer of these dimensions uses on this device (chosen once, at load)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return EMULATED
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9) or in_features % 16 or out_features % 16:
        return EMULATED
    return SCALED_MM_ROWWISE if capability >= (9, 0) else SCALED_MM_TENSORWISE


def quantize_input(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations -> (FP8 codes, float32 scales [M, 1]): per token (on CUDA one fused kernel with
    the same codes), or the static scale."""
    if input_scale is None:
        return kernel_module("fp8_quant").quantize_rows(x.contiguous()) if x.is_cuda else quantize_rows(x)
    scale = input_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return quantize(x, input_scale), scale


def fp8_linear(
    x: torch.Tensor | Fp8Rows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """x [..., K] in the model dtype (or already quantized per token: Fp8Rows), weight [N, K] FP8,
    weight_scale [1, N] float32 -> [..., N]."""
    if weight.dtype != FP8_DTYPE:
        raise TypeError(f"fp8_linear needs {FP8_DTYPE} weights, got {weight.dtype}")
    if isinstance(x, Fp8Rows):
        lead, k = x.codes.shape[:-1], x.codes.shape[-1]
        y = _product(x.codes.reshape(-1, k), x.scales.reshape(-1, 1), weight, weight_scale, x.dtype, backend)
    else:
        lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])
        xq, x_scale = quantize_input(rows, input_scale)
        y = _product(xq, x_scale, weight, weight_scale, rows.dtype, backend)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, weight.shape[0])


def _product(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             dtype: torch.dtype, backend: str) -> torch.Tensor:  # fmt: skip
    """W8A8: codes [M, K] with scales [M, 1] (per token, or the static scale) times the weight, by the
    backend's GEMM, in dtype."""
    if _runs_gemv(backend, xq.shape[0]):
        return kernel_module("gemv").gemv(xq.contiguous(), weight, weight_scale, x_scale=x_scale, out_dtype=dtype)
    if backend == SCALED_MM_ROWWISE:
        return _scaled_mm_rowwise(xq, x_scale, weight, weight_scale, dtype)
    if backend == SCALED_MM_TENSORWISE:
        return _scaled_mm_tensorwise(xq, x_scale, weight, weight_scale, dtype)
    if backend == EMULATED:
        return _emulated(xq, x_scale, weight, weight_scale, dtype)
    raise ValueError(f"unknown FP8 GEMM backend {backend!r}")


def _runs_gemv(backend: str, rows: int) -> bool:
    """Decode-sized batches on FP8 tensor cores run the GEMV (see the module docstring)."""
    return backend in (SCALED_MM_ROWWISE, SCALED_MM_TENSORWISE) and rows <= GEMV_MAX_ROWS


def _emulated(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    acc = torch.mm(xq.to(dtype), weight.to(dtype).t())
    return (acc.float() * x_scale * weight_scale).to(dtype)


def _scaled_mm_rowwise(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    # Row-major codes, column-major weight view, contiguous float32 scales: what the kernel asks for.
    y = torch._scaled_mm(
        xq.contiguous(),
        weight.t(),
        scale_a=x_scale.contiguous(),
        scale_b=weight_scale,
        out_dtype=torch.bfloat16,
        use_fast_accum=True,  # see the module docstring
    )
    return y.to(dtype)


def _scaled_mm_tensorwise(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    one = torch.ones((), dtype=torch.float32, device=xq.device)
    acc = torch._scaled_mm(xq.contiguous(), weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return (acc * x_scale * weight_scale).to(dtype)
