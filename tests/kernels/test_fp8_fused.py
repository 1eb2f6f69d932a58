"""FP8 quantization fused into the kernels that produce the activations (rms_norm_fp8, add_rms_norm_fp8,
silu_and_mul_fp8) and quantize_rows' one-pass and looped paths, under the interpreter: each fused kernel
gives the codes (compared as bytes) and scales of quantize_rows over the unfused kernel's output, bit for
bit, and the residual add_rms_norm's. Rows of many magnitudes, an all-zero row, an empty batch and
widths that are not powers of two. The looped paths run with fp8_quant.MAX_ROW_IN_REGISTERS lowered.

The norm's bits on the GPU also depend on the order its row sum adds in, which the interpreter cannot
show: the last test compiles both norms for sm_90 (in a fresh process, without the interpreter) and
compares their ops and layouts up to the square root.

bfloat16 arithmetic is wrong in Triton's interpreter (loads, stores and casts are right): bf16 inputs
run where the kernel only casts them (quantize_rows; the norm with a float32 weight, whose product is
float32); the rest is for the GPU.
"""

from __future__ import annotations

import re

import pytest
import torch
from tokenspeed_kernels import activation, fp8_quant
from tokenspeed_kernels.activation import silu_and_mul, silu_and_mul_fp8, silu_and_mul_reference
from tokenspeed_kernels.fp8_quant import quantize_rows, row_plan
from tokenspeed_kernels.rmsnorm import (
    add_rms_norm,
    add_rms_norm_fp8,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_fp8,
    rms_norm_reference,
)

from app.worker.quantization.fp8 import REL_ERROR, SUBNORMAL_ERROR, dequantize
from app.worker.quantization.fp8 import quantize_rows as torch_quantize_rows
from tests.support.compile_kernels import check_in_compiler_process

EPS = 1e-6
LOOPED_MAX_ROW = 256  # rows wider than this take the two-pass loop when the tests lower the limit


def take_path(monkeypatch: pytest.MonkeyPatch, width: int, loop: bool) -> None:
    """Rows of `width` take the two-pass loop (the limit lowered) or stay in registers, as asked."""
    if loop:
        monkeypatch.setattr(fp8_quant, "MAX_ROW_IN_REGISTERS", LOOPED_MAX_ROW)
    assert row_plan(width).one_pass is not loop


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def magnitudes(m: int, k: int, seed: int) -> torch.Tensor:
    """float32 rows from 1e-3 to 1e3, the first all zero, the last with one large value (the rest of it
    lands on subnormal codes)."""
    x = torch.randn(m, k, generator=gen(seed)) * torch.logspace(-3, 3, m).view(m, 1)
    x[0] = 0.0
    x[-1, 0] = 1e4
    return x


def assert_same_quantization(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
) -> None:
    codes, scales = got
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert codes.shape == want[0].shape and scales.shape == want[1].shape
    assert torch.equal(codes.view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(scales, want[1])
    assert (codes.view(torch.uint8) & 0x7F).any()  # not all zero


def assert_close_to(got: tuple[torch.Tensor, torch.Tensor], want: torch.Tensor) -> None:
    """The codes stand for the torch reference's values (an unfused kernel that is wrong fails here)."""
    codes, scales = got
    want = want.reshape(codes.shape).float()
    err = (dequantize(codes, scales) - want).abs()
    assert (err <= 2 * REL_ERROR * want.abs() + SUBNORMAL_ERROR * scales + 1e-6 * scales * 448).all()


# quantize_rows ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("k", "loop"), [(7, False), (300, False), (300, True), (2500, True)])
def test_quantize_rows_paths_equal_the_torch_path(
    k: int, loop: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    take_path(monkeypatch, k, loop)
    x = magnitudes(5, k, k).to(dtype)
    assert_same_quantization(quantize_rows(x), torch_quantize_rows(x))


def test_row_plan() -> None:
    assert row_plan(14336) == (16384, True, 16)  # the 8B model's MLP rows, 32 elements a thread
    assert row_plan(4096) == (4096, True, 8)
    assert row_plan(7) == (8, True, 4)
    assert row_plan(fp8_quant.MAX_ROW_IN_REGISTERS + 1) == (fp8_quant.LOOP_BLOCK, False, 4)


# rms_norm_fp8 / add_rms_norm_fp8 ---------------------------------------------------------------------

NORM_DTYPES = [  # (x, weight): same dtypes, and a float32 weight (float32 output rows)
    (torch.float32, torch.float32),
    (torch.float16, torch.float16),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
]


def norm_inputs(
    m: int, k: int, x_dtype: torch.dtype, w_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of many magnitudes (normalised away but for the outlier row) and a weight spanning binades."""
    weight = torch.randn(k, generator=gen(k)) * torch.logspace(-4, 1, k)
    return magnitudes(m, k, m + k).to(x_dtype), weight.to(w_dtype)


@pytest.mark.parametrize(("x_dtype", "w_dtype"), NORM_DTYPES)
@pytest.mark.parametrize("k", [48, 300])
def test_rms_norm_fp8_equals_quantize_rows_of_rms_norm(
    k: int, x_dtype: torch.dtype, w_dtype: torch.dtype
) -> None:
    x, weight = norm_inputs(6, k, x_dtype, w_dtype)
    got = rms_norm_fp8(x, weight, EPS)
    assert_same_quantization(got, quantize_rows(rms_norm(x, weight, EPS)))
    assert_close_to(got, rms_norm_reference(x, weight, EPS))
    assert got[0][0].view(torch.uint8).bitwise_and(0x7F).eq(0).all()  # the all-zero row: ±0


@pytest.mark.parametrize(("x_dtype", "w_dtype"), NORM_DTYPES[:3])  # bf16: the add is bf16 arithmetic
def test_add_rms_norm_fp8_equals_quantize_rows_of_add_rms_norm(
    x_dtype: torch.dtype, w_dtype: torch.dtype
) -> None:
    x, weight = norm_inputs(6, 200, x_dtype, w_dtype)
    residual = torch.randn(6, 200, generator=gen(7)).to(x_dtype)
    residual[0] = -x[0]  # the sum's row is all zero
    fused_residual, unfused_residual = residual.clone(), residual.clone()
    got = add_rms_norm_fp8(x, fused_residual, weight, EPS)
    want = quantize_rows(add_rms_norm(x, unfused_residual, weight, EPS))
    assert torch.equal(fused_residual, unfused_residual) and not torch.equal(fused_residual, residual)
    assert_same_quantization(got, want)
    assert_close_to(got, add_rms_norm_reference(x, residual.clone(), weight, EPS))


def test_norms_fp8_take_leading_dims_and_strided_rows() -> None:
    x, weight = norm_inputs(8, 96, torch.float16, torch.float16)
    x3 = x.view(2, 4, 96)
    got = rms_norm_fp8(x3, weight, EPS)
    assert got[0].shape == (8, 96) and got[1].shape == (8, 1)
    assert_same_quantization(got, quantize_rows(rms_norm(x, weight, EPS)))
    wide = torch.randn(5, 160, generator=gen(3)).half()
    rows = wide[:, :96]  # rows 160 apart
    assert_same_quantization(rms_norm_fp8(rows, weight, EPS), quantize_rows(rms_norm(rows, weight, EPS)))
    residual = torch.randn(8, 96, generator=gen(4)).half()
    unfused_residual = residual.clone()
    got = add_rms_norm_fp8(x3, residual.view(2, 4, 96), weight, EPS)
    assert_same_quantization(got, quantize_rows(add_rms_norm(x, unfused_residual, weight, EPS)))
    assert torch.equal(residual, unfused_residual)


def test_norms_fp8_empty_batch_and_bad_inputs() -> None:
    weight = torch.ones(16)
    for codes, scales in (
        rms_norm_fp8(torch.zeros(0, 16), weight, EPS),
        add_rms_norm_fp8(torch.zeros(0, 16), torch.zeros(0, 16), weight, EPS),
    ):
        assert codes.shape == (0, 16) and codes.dtype == torch.float8_e4m3fn and scales.shape == (0, 1)
    with pytest.raises(ValueError, match="contiguous"):
        add_rms_norm_fp8(torch.zeros(4, 16), torch.zeros(16, 4).t(), weight, EPS)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm_fp8(torch.zeros(16, 4).t(), weight, EPS)


# silu_and_mul_fp8 ------------------------------------------------------------------------------------


def gate_up(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """[m, 2n]: up rows of many magnitudes (row 0 all zero: zero products; the last one's large value puts
    its other products on subnormal codes), gates where SiLU bends, no fp16 overflow."""
    gate = torch.randn(m, n, generator=gen(n + 1)) * 3
    gate[-1, 0] = 1.0
    return torch.cat([gate, magnitudes(m, n, n)], dim=1).to(dtype)


def one_program_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """silu_and_mul_fp8 takes its one-program-a-row path at any number of rows."""
    monkeypatch.setattr(activation, "SPREAD_MAX_ROWS", 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "loop"), [(5, False), (300, False), (300, True), (2500, True)])
def test_silu_and_mul_fp8_equals_quantize_rows_of_silu_and_mul(
    n: int, loop: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    take_path(monkeypatch, n, loop)
    one_program_a_row(monkeypatch)
    x = gate_up(5, n, dtype)
    got = silu_and_mul_fp8(x)
    assert_same_quantization(got, quantize_rows(silu_and_mul(x)))
    assert_close_to(got, silu_and_mul_reference(x))
    assert got[0][0].view(torch.uint8).bitwise_and(0x7F).eq(0).all()  # the all-zero row: ±0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "n"), [(1, 2500), (5, 1025), (16, 3000)])
def test_silu_and_mul_fp8_spread_over_programs_equals_quantize_rows_of_silu_and_mul(
    m: int, n: int, dtype: torch.dtype
) -> None:
    """Up to SPREAD_MAX_ROWS rows wider than a program: the products with a partial amax a program, then
    their codes (fp8_quant.quantize_rows_with_amax), in programs across the row: the same bits."""
    assert m <= activation.SPREAD_MAX_ROWS and n > activation.BLOCK
    x = gate_up(m, n, dtype)
    got = silu_and_mul_fp8(x)
    assert_same_quantization(got, quantize_rows(silu_and_mul(x)))
    assert_close_to(got, silu_and_mul_reference(x))


def test_quantize_rows_with_amax_equals_quantize_rows() -> None:
    x = magnitudes(5, 700, 3).half()
    parts = torch.stack([piece.float().abs().amax(dim=1) for piece in x.tensor_split(3, dim=1)], dim=1)
    for block in (128, 256, 1024):
        assert_same_quantization(fp8_quant.quantize_rows_with_amax(x, parts, block), quantize_rows(x))
    with pytest.raises(ValueError, match="amax must be contiguous float32"):
        fp8_quant.quantize_rows_with_amax(x, parts[:4], 256)


@pytest.mark.parametrize("loop", [False, True])
def test_silu_and_mul_fp8_leading_dims_strided_rows_and_empty_batch(
    loop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    take_path(monkeypatch, 300, loop)
    one_program_a_row(monkeypatch)
    wide = gate_up(6, 400, torch.float16)
    x = wide[:, 100:700]  # gate_up rows of 2 x 300, 800 apart
    got = silu_and_mul_fp8(x.view(2, 3, 600))
    assert got[0].shape == (6, 300) and got[1].shape == (6, 1)
    assert_same_quantization(got, quantize_rows(silu_and_mul(x)))
    codes, scales = silu_and_mul_fp8(torch.zeros(0, 2, 32))
    assert codes.shape == (0, 16) and scales.shape == (0, 1)
    with pytest.raises(ValueError, match="2I"):
        silu_and_mul_fp8(torch.zeros(2, 7))


# The sm_90 compile: the fused norms sum the squares as rms_norm does -----------------------------

IR_CASES = [  # (x dtype, weight dtype, width, residual)
    ("bfloat16", "bfloat16", 4096, False),
    ("bfloat16", "bfloat16", 4096, True),
    ("float16", "float16", 5120, True),
    ("float32", "float32", 4096, False),
    ("bfloat16", "float32", 300, True),
    ("float32", "bfloat16", 8192, False),
]


def sum_of_squares_ir(ttgir: str) -> str:
    """The ops the row sum (the kernel's first reduction) is computed from, in program order and in their
    layouts (which fix the order it adds in: the lowering goes op by op), values renamed, the contiguity
    hint and locations left out."""
    layouts = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    lines = [re.sub(r" loc\(.*", "", line).strip() for line in ttgir.splitlines()]
    defs = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"(%\w+) = ", line))}
    first = next(i for i, line in enumerate(lines) if '"tt.reduce"' in line)
    taken, todo = set(range(first, first + 5)), [first]  # the reduction with its combine region
    while todo:
        operands = re.findall(r"%\w+", lines[todo.pop()].split(" = ", 1)[-1])
        todo += [defs[name] for name in operands if name in defs and defs[name] not in taken]
        taken |= {defs[name] for name in operands if name in defs}
    ops = (re.sub(r", tt.contiguity = dense<\d+> : tensor<1xi32>", "", lines[i]) for i in sorted(taken))
    return "\n".join(
        re.sub(r"#[a-z]\w*", lambda m: layouts.get(m.group(0), m.group(0)), re.sub(r"%\w+", "%", op))
        for op in ops
    )


def compare_norm_ir() -> int:
    """Run in a fresh process: compiles rms_norm and rms_norm_fp8 (or the add_ forms) of each IR_CASES for
    sm_90 through compile_kernels' stand-in driver; prints the cases whose sums differ, returns their count."""
    from tests.support.compile_kernels import compile_for

    def norms(x: torch.Tensor, w: torch.Tensor, residual: bool) -> None:
        if residual:
            add_rms_norm(x, x.clone(), w, EPS)
            add_rms_norm_fp8(x, x.clone(), w, EPS)
        else:
            rms_norm(x, w, EPS)
            rms_norm_fp8(x, w, EPS)

    differ = 0
    for x_dtype, w_dtype, k, residual in IR_CASES:
        x, w = torch.zeros(2, k, dtype=getattr(torch, x_dtype)), torch.zeros(k, dtype=getattr(torch, w_dtype))
        compiled = compile_for(90, lambda x=x, w=w, residual=residual: norms(x, w, residual))
        unfused, fused = (sum_of_squares_ir(kernel.asm["ttgir"]) for kernel in compiled)
        if unfused != fused or "tt.reduce" not in fused:
            differ += 1
            print(f"differ: {x_dtype} x, {w_dtype} weight, {k} wide, residual {residual}")
    return differ


@pytest.mark.slow  # compiles for sm_90
def test_fused_norms_sum_in_rms_norms_order_on_sm90() -> None:
    check_in_compiler_process("tests.kernels.test_fp8_fused:compare_norm_ir")
