"""The decode-sized GEMV (kernels/gemv.py) under the interpreter against a float64 reference.

Weights are 16-bit, or FP8 codes with per-channel scales (read exactly), so what differs is the kernel's
arithmetic: float32 activations accumulate in float32 (REL_TOL 1e-5 relative L2); float16 ones are
multiplied on the dot's float16 path or in float32 registers (FMA), accumulated in float32, and the output
rounds to float16 (2e-3). Every loop body (FMA for a few rows, DOT), split-K with a ragged last split,
and shapes that are not multiples of the tiles (every mask) are covered, and W8A8 (x as FP8 codes with
per-row scales, products of codes exact in float32). bfloat16 runs on the GPU only
(the interpreter has no bf16 dot): tests/gpu/test_fp8_gpu.py.
"""

from __future__ import annotations

import pytest
import tokenspeed_kernels.gemv as gemv_module
import torch
from tokenspeed_kernels.common import FP8_DTYPE, arrival_counts
from tokenspeed_kernels.gemv import (
    MAX_M,
    GemvConfig,
    gemv,
    gemv_reference,
    pick_config,
)

from app.worker.quantization import fp8_linear
from app.worker.quantization.fp8 import Fp8Rows, quantize, quantize_rows
from app.worker.quantization.gemm import SCALED_MM_ROWWISE, SCALED_MM_TENSORWISE
from tests.support.compile_kernels import check_in_compiler_process
from tests.support.numerics import relative_error

REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
CONFIGS = {
    "default": None,
    "fma split 3": GemvConfig(use_dot=False, block_n=4, block_k=32, split_k=3),
    "dot split 2": GemvConfig(use_dot=True, block_n=16, block_k=32, split_k=2),
    "dot, weight as operand A": GemvConfig(use_dot=True, block_n=16, block_k=32, w_as_a=True),
}
FP16_OPERANDS = GemvConfig(use_dot=True, block_n=16, block_k=32, split_k=2, w_as_a=True, fp16_operands=True)


def weight(n: int, k: int, seed: int, fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if not fp8:
        return w.to(torch.float16), None
    codes, scales = quantize_rows(w)
    return codes, scales.view(-1)



SHAPES = [(1, 40, 96), (3, 33, 200), (16, 24, 130)]


@pytest.mark.parametrize("fp8", [False, True], ids=["fp16 weight", "fp8 weight"])
@pytest.mark.parametrize(
    ("config", "m", "n", "k"),
    [(name, *shape) for name, cfg in CONFIGS.items() for shape in SHAPES
     if cfg is None or cfg.problem(shape[0], torch.float16, torch.float16) is None],  # the FMA body: 4 rows at most
)  # fmt: skip
def test_gemv_matches_float64(m: int, n: int, k: int, fp8: bool, config: str) -> None:
    cfg = CONFIGS[config]
    w, scale = weight(n, k, seed=m + n, fp8=fp8)
    for dtype in ([torch.float32, torch.float16] if fp8 else [torch.float16]):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
        got, want = gemv(x, w, scale, cfg), gemv_reference(x, w, scale)
        assert got.dtype == dtype and got.shape == (m, n)
        assert relative_error(got, want) < REL_TOL[dtype]


@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (5, 33, 200)])
def test_fp8_codes_as_float16_with_prescaled_bf16_x(m: int, n: int, k: int) -> None:
    """The float16 route for FP8 weights: x is scaled by 2^-8 into float16's range and the product back
    (float16 x is taken as it is). Runs on float16 x here; bf16 on the GPU."""
    w, scale = weight(n, k, seed=m, fp8=True)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(torch.float16) * 100
    got, want = gemv(x, w, scale, FP16_OPERANDS), gemv_reference(x, w, scale)
    assert relative_error(got, want) < REL_TOL[torch.float16]
    with pytest.raises(ValueError, match="float16 operands serve FP8 weights"):
        gemv(x, w.to(torch.float16), None, FP16_OPERANDS)


def test_split_k_equals_one_pass() -> None:
    """Splits are summed in order in float32: the same products to within float32 rounding."""
    w, scale = weight(20, 300, seed=1, fp8=True)
    x = torch.randn(2, 300, generator=torch.Generator().manual_seed(2))
    whole = gemv(x, w, scale, GemvConfig(use_dot=False, block_n=4, block_k=64, split_k=1))
    split = gemv(x, w, scale, GemvConfig(use_dot=False, block_n=4, block_k=64, split_k=4))
    assert torch.allclose(whole, split, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m", [1, 5])
def test_the_last_split_sums_in_split_order_and_leaves_the_counts_at_zero(m: int) -> None:
    """Split-K's sums inside the GEMV (the last split of each N block to finish adds them): the float32
    partials of each split added in split order, then scaled, call after call (each leaves its arrival
    counts at zero for the next)."""
    w, scale = weight(37, 300, seed=m, fp8=True)
    x = torch.randn(m, 300, generator=torch.Generator().manual_seed(m))
    split = GemvConfig(use_dot=m > 4, block_n=4 if m <= 4 else 16, block_k=32, split_k=3)  # K pieces 128, 128, 44
    pieces = [(x[:, a:b].double() @ w[:, a:b].double().t()).float() for a, b in ((0, 128), (128, 256), (256, 300))]
    want = ((pieces[0] + pieces[1]) + pieces[2]) * scale
    for _ in range(2):
        assert torch.allclose(gemv(x, w, scale, split), want, rtol=1e-6, atol=1e-6)
        assert not arrival_counts(x.device, 1).any()


def test_chosen_configs_serve_every_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """What pick_config gives on a GPU (the measured table, else the defaults) can serve the rows it is
    picked for: a table entry filed under the wrong row bucket, or a default the kernel refuses, fails."""
    monkeypatch.setattr(gemv_module, "INTERPRETING", False)
    shapes = {(n, k) for (_, _, n, k) in gemv_module._MEASURED} | {(1000, 200)}
    for m in range(1, MAX_M + 1):
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            for n, k in shapes:
                assert pick_config(m, n, k, dtype).problem(m, dtype, torch.bfloat16) is None, (m, dtype, n, k)


def test_gemv_refuses_what_it_does_not_serve() -> None:
    w, scale = weight(16, 32, seed=0, fp8=True)
    with pytest.raises(ValueError, match=f"1 to {MAX_M} rows"):
        gemv(torch.randn(MAX_M + 1, 32), w, scale)
    with pytest.raises(ValueError, match="weight of"):
        gemv(torch.randn(2, 32), w.float(), scale)
    with pytest.raises(ValueError, match="FP8 codes need N=16 scales"):
        gemv(torch.randn(2, 32), w, None)
    with pytest.raises(ValueError, match="cannot serve 8 rows"):
        gemv(torch.randn(8, 32), w, scale, GemvConfig(use_dot=False, block_n=4, block_k=32))


W8A8_CONFIGS = {
    "default": None,
    "weight as operand A, split 3": GemvConfig(use_dot=True, block_n=16, block_k=32, split_k=3, w_as_a=True,
                                               fp8_operands=True),
    "x as operand A, split 2": GemvConfig(use_dot=True, block_n=16, block_k=32, split_k=2, fp8_operands=True),
}


@pytest.mark.parametrize("config", list(W8A8_CONFIGS))
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_w8a8_gemv_multiplies_codes_by_codes(m: int, n: int, k: int, config: str) -> None:
    """x as FP8 codes with per-row scales: the float64 product of the dequantized x and weight, rounded
    once (the products of codes are exact in float32; only the float32 sums round)."""
    cfg = W8A8_CONFIGS[config]
    w, scale = weight(n, k, seed=m + n, fp8=True)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(torch.float16) * 3
    codes, x_scale = quantize_rows(x)
    got = gemv(codes, w, scale, cfg, x_scale, torch.float16)
    assert got.dtype == torch.float16 and got.shape == (m, n)
    assert relative_error(got, gemv_reference(codes, w, scale, x_scale, torch.float16)) < REL_TOL[torch.float16]


def test_w8a8_gemv_refuses_codes_without_their_scales() -> None:
    w, scale = weight(16, 32, seed=0, fp8=True)
    codes, x_scale = quantize_rows(torch.randn(2, 32))
    with pytest.raises(ValueError, match="M=2 row scales and an out_dtype"):
        gemv(codes, w, scale, None, None, torch.float16)
    with pytest.raises(ValueError, match="M=2 row scales and an out_dtype"):
        gemv(codes, w, scale, None, x_scale)
    with pytest.raises(ValueError, match="row scales go with x as FP8 codes"):
        gemv(torch.randn(2, 32), w, scale, None, x_scale)
    with pytest.raises(ValueError, match="FP8 operands go with x as FP8 codes"):
        gemv(codes, w, scale, GemvConfig(use_dot=True, block_n=16, block_k=32), x_scale, torch.float16)
    with pytest.raises(ValueError, match="FP8 operands go with x as FP8 codes"):
        gemv(torch.randn(2, 32), w, scale, GemvConfig(True, 16, 32, fp8_operands=True))
    with pytest.raises(ValueError, match="FP8 operands serve FP8 weights"):
        gemv(codes, w.float().half(), None, GemvConfig(True, 16, 32, fp8_operands=True), x_scale, torch.float16)


@pytest.mark.parametrize("backend", [SCALED_MM_ROWWISE, SCALED_MM_TENSORWISE])
def test_decode_sized_batches_take_the_w8a8_gemv(backend: str) -> None:
    """Up to GEMV_MAX_ROWS rows the FP8-capable backends run the GEMV on x quantized per token (W8A8, the
    numbers of the larger batches): quantized inside, or handed over as Fp8Rows, bit for bit the same;
    a static input scale quantizes x before the GEMV."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 64, generator=gen).to(torch.float16)
    w_codes, w_scale = quantize_rows(torch.randn(32, 64, generator=gen))
    bias = torch.randn(32, generator=gen).to(torch.float16)
    got = fp8_linear(x, w_codes, w_scale.view(1, -1), None, bias, backend)
    x_codes, x_scale = quantize_rows(x)
    want = gemv_reference(x_codes, w_codes, w_scale.view(-1), x_scale, torch.float16) + bias
    assert torch.allclose(got.float(), want.float(), rtol=2**-9, atol=2e-3)
    handed = fp8_linear(Fp8Rows.of(x), w_codes, w_scale.view(1, -1), None, bias, backend)
    assert torch.equal(handed, got)
    static = torch.tensor(0.05)
    got_static = fp8_linear(x, w_codes, w_scale.view(1, -1), static, None, backend)
    want_static = gemv_reference(quantize(x, static), w_codes, w_scale.view(-1), static.expand(5), torch.float16)
    assert torch.allclose(got_static.float(), want_static.float(), rtol=2**-9, atol=2e-3)


def table_loop_loads() -> int:
    """Run in a fresh process: compiles the GEMV for sm_90 (PDL on) at each entry of its measured table that
    multiplies on the tensor cores, and counts those whose K loop has a load that is not an asynchronous
    copy: the table's timings assume the weight and x tiles requested stages ahead."""
    from tests.support.compile_kernels import count_unpipelined

    cases = []
    for (kind, m, n, k), config in gemv_module._MEASURED.items():
        if not config.use_dot:
            continue
        w, scale = (torch.zeros(n, k, dtype=torch.bfloat16), None) if kind == "16" else (torch.zeros(n, k).to(FP8_DTYPE), torch.ones(n))
        x = torch.zeros(m, k).to(FP8_DTYPE) if kind == "w8a8" else torch.zeros(m, k, dtype=torch.bfloat16)
        x_scale = torch.ones(m, 1) if kind == "w8a8" else None
        cases.append((f"{kind} m={m} n={n} k={k} {config}",
                      lambda x=x, w=w, s=scale, c=config, xs=x_scale: gemv(x, w, s, c, xs, torch.bfloat16)))  # fmt: skip
    return count_unpipelined(cases)


@pytest.mark.slow  # compiles the table's kernels for sm_90
def test_table_configs_pipeline_their_loads_on_sm90() -> None:
    check_in_compiler_process("tests.kernels.test_gemv:table_loop_loads")


def test_the_workers_gemv_row_limit_is_the_kernels() -> None:
    """app keeps its own copy of MAX_M so that a CPU worker never imports the kernels (Triton)."""
    from app.worker.layers.linear import GEMV_MAX_M

    assert GEMV_MAX_M == gemv_module.MAX_M
