"""Decode-sized linear layers: y [M, N] = x [M, K] @ W [N, K]^T for a few rows (M <= MAX_M), where W is
16-bit, or FP8 e4m3 codes with per-output-channel scales [N]; x is 16-bit (W8A16 with FP8 codes), or
FP8 codes with per-row scales [M] (W8A8: what the FP8 model runs, app/worker/quantization/gemm.py).

At decode sizes a linear layer is bound by reading W once, so the kernel is shaped for bytes in flight,
not for FLOPs. Two loop bodies:
- FMA (M <= FMA_MAX_M): the rows are broadcast against a [BLOCK_N, BLOCK_K] weight tile and multiplied in
  float32 registers, summed over K once at the end: no padding of M and no shared-memory staging, so
  BLOCK_N can be as small as a few rows and many programs stream W at once.
- DOT: tl.dot with the rows padded to 16 (float32 accumulation on the tensor cores), optionally with the
  weight tile as the register operand (y^T = W x^T). W8A8 multiplies codes by codes on the FP8 tensor
  cores, nothing converted in registers (12% faster than W8A16 over the 8B model's layers on the H200).
  W8A16's codes go to the tensor cores as float16, x with them (bfloat16 x scaled by 2^-8 into float16's
  range, exactly, and the product back), because a cast to bfloat16 halves their stream rate there.
Split-K: with SPLIT_K > 1 the grid is (N blocks, SPLIT_K) and each program writes float32 partial sums to a
[SPLIT_K, M, N] buffer; the last split of each N block to finish (an atomic count) adds them in split order
(deterministic, unlike atomic adds of the sums), scales and casts, in the same kernel (on the H200 as fast
as a second kernel doing it or faster: 0.14 to 0.16 us on the 8B layer's split shapes at one row). It pays
where N / BLOCK_N alone gives too few programs to fill the GPU.

FP8 codes are exact in every float type, so the products are those of the dequantized weight (and, W8A8,
x); the per-row scales of x multiply the float32 sums.
Under programmatic dependent launch (common.set_pdl) each program waits for the kernel before it first;
its pipeline then requests its first stages of weights and x together.
`pick_config` holds the configuration measured fastest per shape on the H200
(scripts/gpu/bench_gemv.py); any explicit `GemvConfig` runs as given.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .common import (
    FP8_DTYPE,
    INTERPRETING,
    arrival_counts,
    check_last_dim_contiguous,
    dot_precision,
    last_to_arrive,
    pdl_options,
    wait_for_predecessor,
)

MAX_M = 16
FMA_MAX_M = 4
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, FP8_DTYPE)


@dataclass(frozen=True)
class GemvConfig:
    use_dot: bool
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    w_as_a: bool = False  # DOT: y^T = W x^T, the weight tile as operand A (faster on some shapes)
    # DOT with FP8 codes: multiply in float16 (W and x cast to it) rather than in x's dtype. On the H200
    # codes cast to bfloat16 stream at about half the rate of a cast to float16 (one hardware conversion
    # per two codes); a float16 built from the codes' bits by integer instructions measured slower still.
    fp16_operands: bool = False
    # DOT with FP8 codes: x comes quantized per token to e4m3 too (W8A8: codes with per-row scales), so the
    # tensor cores multiply codes by codes with no conversion in registers. (x quantized by each program
    # itself measured several times slower: every program must read all of x for the scales first.)
    fp8_operands: bool = False

    def block_m(self, m: int) -> int:
        return 16 if self.use_dot else triton.next_power_of_2(m)

    def problem(self, m: int, weight_dtype: torch.dtype, x_dtype: torch.dtype) -> str | None:
        """Why this configuration cannot serve m rows of x_dtype against weight_dtype (None: it can)."""
        if self.split_k < 1 or m > (MAX_M if self.use_dot else FMA_MAX_M):
            return f"config {self} cannot serve {m} rows"
        if self.fp16_operands and (
            not self.use_dot or weight_dtype != FP8_DTYPE or x_dtype not in (torch.float16, torch.bfloat16)
        ):
            return f"config {self}: float16 operands serve FP8 weights, 16-bit x and the DOT body"
        if self.fp8_operands and (not self.use_dot or weight_dtype != FP8_DTYPE or self.fp16_operands):
            return f"config {self}: FP8 operands serve FP8 weights and the DOT body"
        if (x_dtype == FP8_DTYPE) != self.fp8_operands:
            return f"config {self}: FP8 operands go with x as FP8 codes, and only with them"
        return None


@triton.jit
def _load_k_tile(rows, kk, k_end, row_ok, EVEN_K: tl.constexpr):
    """rows[:, kk] of the rows that exist (zeros elsewhere): a weight or an activation tile."""
    if EVEN_K:  # no K mask: keeps the loads vectorised
        tile = tl.load(rows + kk[None, :], mask=row_ok[:, None], other=0.0)
    else:
        tile = tl.load(rows + kk[None, :], mask=row_ok[:, None] & (kk < k_end)[None, :], other=0.0)
    return tile


@triton.jit
def _accumulate(acc, w, x, USE_DOT: tl.constexpr, W_AS_A: tl.constexpr, FP16_OPERANDS: tl.constexpr,
                FP8_OPERANDS: tl.constexpr, X_PRESCALE: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """acc += the tile's products: [BLOCK_M, BLOCK_N] (DOT; transposed with W_AS_A) or, FMA, the
    elementwise products [BLOCK_M, BLOCK_N, BLOCK_K] summed over K once at the end."""
    if USE_DOT:
        if FP16_OPERANDS:
            if X_PRESCALE:  # bfloat16 x into float16's range; exact (a power of two)
                x = x.to(tl.float32) * 0.00390625
            x = x.to(tl.float16)
            w = w.to(tl.float16)
        elif not FP8_OPERANDS:  # FP8 operands: codes times codes as they are
            w = w.to(x.dtype)
        if W_AS_A:
            acc += tl.dot(w, tl.trans(x), input_precision=PRECISION)
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    else:
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr, xs_ptr, w_ptr, scale_ptr, y_ptr, parts_ptr, arrivals_ptr,
    M, N, K, K_PER_SPLIT, SPLITS,
    stride_xm, stride_wn, stride_ym,
    HAS_SCALE: tl.constexpr, USE_DOT: tl.constexpr, W_AS_A: tl.constexpr, FP16_OPERANDS: tl.constexpr,
    FP8_OPERANDS: tl.constexpr,
    X_PRESCALE: tl.constexpr, OUT_FACTOR: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + rm[:, None] * stride_xm
    if USE_DOT:
        if W_AS_A:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    # Under PDL the wait comes first and the loop's own pipeline then requests its first stages (weights and
    # x) together: a weight tile peeled off before the wait put the first x load and product, one more
    # round trip, ahead of the pipeline's first requests (with the scales read here, not after the loop
    # or the split sums: batch-1 decode 1.6 to 1.9% faster on the H200, bf16 and FP8).
    if HAS_SCALE:
        w_scales = tl.load(scale_ptr + rn, mask=n_ok, other=0.0)
    else:
        w_scales = tl.full((BLOCK_N,), 1.0, tl.float32)
    wait_for_predecessor(USE_PDL)
    if FP8_OPERANDS:  # x's per-token scales, written by the kernel before
        x_scales = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)
    for k0 in range(k_start, k_end, BLOCK_K):
        w = _load_k_tile(w_rows, k0 + rk, k_end, n_ok, EVEN_K)
        x = _load_k_tile(x_rows, k0 + rk, k_end, m_ok, EVEN_K)
        acc = _accumulate(acc, w, x, USE_DOT, W_AS_A, FP16_OPERANDS, FP8_OPERANDS, X_PRESCALE, PRECISION)
    if not USE_DOT:
        acc = tl.sum(acc, axis=2)
    elif W_AS_A:
        acc = tl.trans(acc)
    if OUT_FACTOR != 1.0:
        acc = acc * OUT_FACTOR
    if FP8_OPERANDS:  # x's per-token scales: linear, so partial sums take them too
        acc = acc * x_scales[:, None]
    out_mask = m_ok[:, None] & n_ok[None, :]
    y = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    if PARTIAL:  # parts [SPLITS, M, N], contiguous
        parts = parts_ptr + rm[:, None] * N + rn[None, :]
        tl.store(parts + pid_k * M * N, acc, mask=out_mask)
        _sum_if_last_split(parts, M * N, w_scales, y, arrivals_ptr + pid_n, out_mask, SPLITS, HAS_SCALE, BLOCK_M,
                           BLOCK_N)  # fmt: skip
    else:
        if HAS_SCALE:
            acc = acc * w_scales[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _sum_if_last_split(parts, split_stride, w_scales, y, arrivals, out_mask, SPLITS, HAS_SCALE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The last split of the N block to finish adds the block's partial sums in split order, scales and
    stores y."""
    if last_to_arrive(arrivals, SPLITS):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(0, SPLITS):
            acc += tl.load(parts + s * split_stride, mask=out_mask, other=0.0, cache_modifier=".cg")
        if HAS_SCALE:
            acc = acc * w_scales[None, :]
        tl.store(y, acc.to(y.dtype.element_ty), mask=out_mask)


# Measured on one H200 (scripts/gpu/bench_gemv.py): the fastest configuration per weight dtype, row bucket
# and shape, keyed by ("fp8" or "16", rows rounded up to one of ROW_BUCKETS, N, K). A 16-bit shape runs here
# only where it beat cuBLAS there; elsewhere torch's linear does.
ROW_BUCKETS = (1, 4, 8, 16)
_MEASURED: dict[tuple[str, int, int, int], GemvConfig] = {
    # Llama-3.1-8B at TP 1 (qkv, o, gate_up, down). 16-bit: only where 2% or more faster than cuBLAS
    # (rows 2 to 16 of gate_up and down: cuBLAS equal, so they go to cuBLAS).
    ("16", 1, 6144, 4096): GemvConfig(True, 64, 256, 1, 4, 4, True),
    ("16", 1, 4096, 4096): GemvConfig(False, 8, 1024, 1, 4, 3),
    ("16", 1, 28672, 4096): GemvConfig(True, 64, 128, 1, 4, 4, True),
    ("16", 1, 4096, 14336): GemvConfig(False, 8, 1024, 1, 4, 3),
    ("16", 4, 6144, 4096): GemvConfig(True, 64, 256, 1, 4, 4, True),
    ("16", 4, 4096, 4096): GemvConfig(True, 64, 256, 1, 4, 4, True),
    ("16", 8, 6144, 4096): GemvConfig(True, 64, 256, 1, 4, 4, True),
    ("16", 8, 4096, 4096): GemvConfig(True, 64, 256, 1, 4, 4, True),
    ("16", 16, 6144, 4096): GemvConfig(True, 64, 256, 1, 4, 4, True),
    ("16", 16, 4096, 4096): GemvConfig(True, 64, 128, 2, 4, 4, True),
    # Qwen3-30B-A3B's attention at TP 1 (qkv, o), one row: 5-16% faster than cuBLAS (its experts run
    # kernels/moe.py).
    ("16", 1, 5120, 2048): GemvConfig(True, 64, 256, 1, 4, 4, True),
    ("16", 1, 2048, 4096): GemvConfig(False, 4, 1024, 1, 4, 3),
    # FP8 codes: pick_config's default is the fastest on every shape and row count but these.
    ("fp8", 1, 4096, 4096): GemvConfig(False, 8, 1024, 1, 4, 3),
    ("fp8", 4, 4096, 14336): GemvConfig(True, 32, 256, 4, 4, 3, True, True),
    ("fp8", 1, 2048, 4096): GemvConfig(True, 32, 256, 4, 4, 3, True, True),
    # W8A8 (x as FP8 codes too): the fastest of 40 configurations a shape at 1 and 16 rows; at 1 row picked
    # after the producer kernel under PDL in a graph (bench_gemv_chain.py), as the decode step runs them:
    # alone, a GEMV's fastest tile differs from its fastest behind a producer.
    ("w8a8", 1, 6144, 4096): GemvConfig(True, 64, 512, 1, 4, 3, True, fp8_operands=True),
    ("w8a8", 1, 4096, 4096): GemvConfig(True, 64, 128, 4, 4, 4, True, fp8_operands=True),
    ("w8a8", 1, 28672, 4096): GemvConfig(True, 128, 256, 1, 4, 3, True, fp8_operands=True),
    ("w8a8", 1, 4096, 14336): GemvConfig(True, 64, 256, 4, 4, 4, True, fp8_operands=True),
    ("w8a8", 1, 2048, 4096): GemvConfig(True, 64, 512, 4, 4, 3, True, fp8_operands=True),
    ("w8a8", 16, 6144, 4096): GemvConfig(True, 64, 256, 1, 4, 4, True, fp8_operands=True),
    ("w8a8", 16, 4096, 4096): GemvConfig(True, 64, 128, 4, 4, 4, True, fp8_operands=True),
    ("w8a8", 16, 28672, 4096): GemvConfig(True, 128, 256, 1, 4, 3, True, fp8_operands=True),
    ("w8a8", 16, 4096, 14336): GemvConfig(True, 64, 256, 4, 4, 3, True, fp8_operands=True),
}


def measured_config(m: int, n: int, k: int, weight_dtype: torch.dtype, fp8_x: bool = False) -> GemvConfig | None:
    """The configuration measured fastest for this shape (None: not measured, or cuBLAS was faster);
    fp8_x: for x quantized to FP8 too (W8A8)."""
    if INTERPRETING or weight_dtype not in WEIGHT_DTYPES or not 1 <= m <= MAX_M:
        return None
    bucket = next(b for b in ROW_BUCKETS if b >= m)
    kind = ("w8a8" if fp8_x else "fp8") if weight_dtype == FP8_DTYPE else "16"
    return _MEASURED.get((kind, bucket, n, k))


def pick_config(m: int, n: int, k: int, weight_dtype: torch.dtype, fp8_x: bool = False) -> GemvConfig:
    """The measured configuration for this shape, else a default. For FP8 codes the default is the
    configuration that came within 7% of the best on every measured shape and row count (the best on
    all but two): 64-row tiles with float16 operands, split 4 ways along K unless N alone gives enough
    programs (N of 28672: 448 tiles). fp8_x: x quantized to FP8 as well (FP8 operands): 64 x 256 tiles,
    split 4 ways along a K over 8192 unless N gives 256 tiles (within 4% of the best at 1 and 16 rows on
    every 8B shape)."""
    found = measured_config(m, n, k, weight_dtype, fp8_x)
    if found is not None:
        return found
    if INTERPRETING:
        return GemvConfig(use_dot=m > FMA_MAX_M or fp8_x, block_n=16, block_k=64, fp8_operands=fp8_x)
    if weight_dtype == FP8_DTYPE and fp8_x:
        split = 4 if k > 8192 and triton.cdiv(n, 64) < 256 else 1
        return GemvConfig(True, 64, 256, split, 4, 4, w_as_a=True, fp8_operands=True)
    if weight_dtype == FP8_DTYPE:
        split = 1 if triton.cdiv(n, 64) >= 256 else 4
        return GemvConfig(True, 64, 128, split, 4, 4, fp16_operands=True)
    if m <= FMA_MAX_M:
        return GemvConfig(use_dot=False, block_n=max(1, 8 // triton.next_power_of_2(m)), block_k=512)
    return GemvConfig(use_dot=True, block_n=16, block_k=256, num_stages=4)


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
         config: GemvConfig | None = None, x_scale: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_M; float16, bfloat16 or float32, or FP8 codes with per-row scales x_scale [M] or
    [M, 1]), weight [N, K] 16-bit or float8_e4m3fn, scale [N] float32 for FP8 codes (None for a 16-bit
    weight) -> [M, N] in out_dtype (default: x's dtype; needed for codes)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    _check(x, weight, scale, m, k, n, x_scale, out_dtype)
    cfg = config or pick_config(m, n, k, weight.dtype, fp8_x=x.dtype == FP8_DTYPE)
    if config is None and cfg.fp16_operands and x.dtype == torch.float32:
        cfg = replace(cfg, fp16_operands=False)  # float32 x keeps its precision
    problem = cfg.problem(m, weight.dtype, x.dtype)
    if problem is not None:
        raise ValueError(problem)
    prescale = cfg.fp16_operands and x.dtype == torch.bfloat16
    out_factor = 256.0 if prescale else 1.0
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    scale_arg = y if scale is None else scale.reshape(-1).float().contiguous()  # unread when HAS_SCALE is off
    xs_arg = y if x_scale is None else x_scale.reshape(-1).float().contiguous()  # read with FP8 operands only
    # Each split covers a whole number of blocks: only the last may run past K.
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    partial = splits > 1
    n_blocks = triton.cdiv(n, cfg.block_n)
    # Without splits neither the partial sums nor the counts are read.
    parts = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if partial else y
    arrivals = arrival_counts(x.device, n_blocks) if partial else y
    _gemv_kernel[(n_blocks, splits)](
        x, xs_arg, weight, scale_arg, y, parts, arrivals, m, n, k, k_per_split, splits, x.stride(0), weight.stride(0),
        y.stride(0),
        HAS_SCALE=scale is not None, USE_DOT=cfg.use_dot, W_AS_A=cfg.w_as_a, FP16_OPERANDS=cfg.fp16_operands,
        FP8_OPERANDS=cfg.fp8_operands,
        X_PRESCALE=prescale, OUT_FACTOR=out_factor, PARTIAL=partial, EVEN_K=k % cfg.block_k == 0,
        PRECISION=dot_precision(torch.float16 if cfg.fp16_operands or cfg.fp8_operands else x.dtype),
        BLOCK_M=cfg.block_m(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(),
    )  # fmt: skip
    return y


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, m: int, k: int, n: int,
           x_scale: torch.Tensor | None, out_dtype: torch.dtype | None) -> None:  # fmt: skip
    """What gemv serves: 1 to MAX_M rows, a 2-D weight of its dtypes with scales for
    FP8 codes, x's row scales with FP8 x only."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"gemv serves 1 to {MAX_M} rows, got {m}")
    if weight.dim() != 2 or weight.shape[1] != k or weight.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"gemv needs an [N, {k}] weight of {WEIGHT_DTYPES}, got {tuple(weight.shape)} {weight.dtype}")
    if (weight.dtype == FP8_DTYPE) != (scale is not None) or (scale is not None and scale.numel() != n):
        raise ValueError(f"FP8 codes need N={n} scales and a 16-bit weight none, got {weight.dtype} with "
                         f"{None if scale is None else scale.numel()} scales")
    if x.dtype == FP8_DTYPE and (x_scale is None or x_scale.numel() != m or out_dtype is None):
        raise ValueError(f"x as FP8 codes needs M={m} row scales and an out_dtype")
    if x.dtype != FP8_DTYPE and x_scale is not None:
        raise ValueError(f"row scales go with x as FP8 codes, not {x.dtype}")
    check_last_dim_contiguous("weight", weight)


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                   x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The same product in float64 (codes times scales), rounded to out_dtype (default x's) once."""
    w = weight.double() if scale is None else weight.double() * scale.reshape(-1, 1).double()
    xd = x.double() if x_scale is None else x.double() * x_scale.reshape(-1, 1).double()
    return (xd @ w.t()).to(out_dtype or x.dtype)
