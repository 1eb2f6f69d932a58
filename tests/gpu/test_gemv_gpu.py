"""kernels/gemv.py on CUDA (skipped without it), in bfloat16 (the interpreter has none): every loop body,
split-K and the configurations measured for the 8B shapes against a float64 reference (FP8 weights with
16-bit x, and W8A8: x as FP8 codes too), and the 16-bit
Linear's dispatch (the GEMV where it was measured faster than cuBLAS, torch's linear elsewhere) giving
the same numbers as torch's linear to bf16 rounding."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tokenspeed_kernels.gemv import (
    GemvConfig,
    gemv,
    gemv_reference,
    pick_config,
)

from app.worker.layers.linear import Linear
from app.worker.quantization import quantize_rows
from tests.support.numerics import relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda", 0)
SHAPES = [(6144, 4096), (4096, 14336), (1000, 200)]
CONFIGS = [
    None,
    GemvConfig(use_dot=False, block_n=4, block_k=1024, split_k=2),
    GemvConfig(use_dot=True, block_n=32, block_k=256, split_k=4, num_stages=3),
    GemvConfig(use_dot=True, block_n=64, block_k=256, split_k=2, w_as_a=True),
    GemvConfig(use_dot=True, block_n=64, block_k=128, split_k=2, w_as_a=True, fp16_operands=True),
    GemvConfig(use_dot=True, block_n=64, block_k=128, split_k=4, fp16_operands=True),
]

W8A8_CONFIGS = [
    None,
    GemvConfig(use_dot=True, block_n=64, block_k=256, split_k=4, w_as_a=True, fp8_operands=True),
    GemvConfig(use_dot=True, block_n=128, block_k=256, split_k=2, num_warps=8, w_as_a=True, fp8_operands=True),
    GemvConfig(use_dot=True, block_n=32, block_k=256, split_k=2, fp8_operands=True),
]


def weight_dtype(fp8: bool) -> torch.dtype:
    return torch.float8_e4m3fn if fp8 else torch.bfloat16


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize(
    ("config", "m", "fp8"),
    [(i, m, fp8) for i, cfg in enumerate(CONFIGS) for m in (1, 3, 8, 16) for fp8 in (False, True)
     if cfg is None or cfg.problem(m, weight_dtype(fp8), torch.bfloat16) is None],  # FMA: 4 rows; float16: FP8
)  # fmt: skip
def test_gemv_in_bf16_matches_float64(n: int, k: int, m: int, config: int, fp8: bool) -> None:
    cfg = CONFIGS[config] or pick_config(m, n, k, weight_dtype(fp8))
    gen = torch.Generator(device=CUDA).manual_seed(n + m)
    w = torch.randn(n, k, generator=gen, device=CUDA) * 0.02
    w, scale = quantize_rows(w) if fp8 else (w.to(torch.bfloat16), None)
    scale = None if scale is None else scale.view(-1)
    x = torch.randn(m, k, generator=gen, device=CUDA).to(torch.bfloat16)
    assert relative_error(gemv(x, w, scale, cfg), gemv_reference(x, w, scale)) < 1e-2


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("config", range(len(W8A8_CONFIGS)))
def test_w8a8_gemv_in_bf16_matches_float64(n: int, k: int, m: int, config: int) -> None:
    """x as FP8 codes times FP8 codes on the tensor cores."""
    cfg = W8A8_CONFIGS[config] or pick_config(m, n, k, torch.float8_e4m3fn, fp8_x=True)
    gen = torch.Generator(device=CUDA).manual_seed(n + m)
    w, scale = quantize_rows(torch.randn(n, k, generator=gen, device=CUDA) * 0.02)
    x = torch.randn(m, k, generator=gen, device=CUDA).to(torch.bfloat16)
    codes, x_scale = quantize_rows(x)
    got = gemv(codes, w, scale.view(-1), cfg, x_scale, torch.bfloat16)
    want = gemv_reference(codes, w, scale.view(-1), x_scale, torch.bfloat16)
    assert relative_error(got, want) < 1e-2


@pytest.mark.parametrize("m", [1, 4, 8, 16, 17])
def test_linear_gives_torch_linear_numbers(m: int) -> None:
    torch.manual_seed(m)
    layer = Linear(4096, 6144, bias=True, dtype=torch.bfloat16).to(CUDA)
    with torch.no_grad():
        layer.weight.normal_(std=0.02)
        layer.bias.normal_()
        x = torch.randn(m, 4096, device=CUDA).to(torch.bfloat16)
        got, want = layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert got.shape == want.shape and relative_error(got, want) < 1e-2


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability(CUDA) < (9, 0),
                    reason="programmatic dependent launch needs compute capability 9.0")
@pytest.mark.parametrize("kind", ["bf16", "fp8", "w8a8", "w8a8 split 4", "w8a8 after quantize_rows"])
def test_gemv_after_a_norm_under_pdl_in_a_graph_gives_the_plain_numbers(kind: str) -> None:
    """The GEMV reads its weight scales before waiting for the kernel before it (the norm that writes its
    x, or x's codes and scales for W8A8; or quantize_rows, o_proj's producer), and the norm its weight:
    replayed in a graph, PDL on must give the plain launches' bits."""
    from tokenspeed_kernels.common import set_pdl
    from tokenspeed_kernels.fp8_quant import quantize_rows as quantize_rows_kernel
    from tokenspeed_kernels.rmsnorm import rms_norm, rms_norm_fp8

    gen = torch.Generator(device=CUDA).manual_seed(7)
    norm_weight = torch.rand(4096, generator=gen, device=CUDA).to(torch.bfloat16)
    w = torch.randn(6144, 4096, generator=gen, device=CUDA) * 0.02
    w, scale = (w.to(torch.bfloat16), None) if kind == "bf16" else quantize_rows(w)
    scale = None if scale is None else scale.view(-1)
    w8a8 = kind.startswith("w8a8")
    cfg = pick_config(1, 6144, 4096, w.dtype, fp8_x=w8a8)
    if kind.endswith("split 4"):  # the sums by the last split of each N block
        cfg = replace(cfg, split_k=4)
    hidden = torch.zeros(1, 4096, device=CUDA, dtype=torch.bfloat16)

    def norm_then_gemv() -> torch.Tensor:
        if kind.endswith("quantize_rows"):
            codes, scales = quantize_rows_kernel(hidden)
            return gemv(codes, w, scale, cfg, scales, torch.bfloat16)
        if w8a8:
            codes, scales = rms_norm_fp8(hidden, norm_weight, 1e-5)
            return gemv(codes, w, scale, cfg, scales, torch.bfloat16)
        return gemv(rms_norm(hidden, norm_weight, 1e-5), w, scale, cfg)

    outputs = []
    for pdl in (False, True):
        set_pdl(pdl)
        try:
            chain = lambda: [norm_then_gemv() for _ in range(8)]  # noqa: E731
            chain()  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                ys = chain()
        finally:
            set_pdl(False)
        results = []
        for step in range(5):
            hidden.copy_(torch.randn(1, 4096, generator=gen.manual_seed(step), device=CUDA))
            graph.replay()
            results.append(torch.stack(ys).clone())
        outputs.append(torch.stack(results))
    assert torch.equal(outputs[0], outputs[1])
    assert outputs[0].abs().sum() > 0


def test_measured_fp8_configs_serve_float32_activations() -> None:
    """The table's float16 routes would round float32 x: such calls take the native cast instead."""
    gen = torch.Generator(device=CUDA).manual_seed(0)
    w, scale = quantize_rows(torch.randn(6144, 4096, generator=gen, device=CUDA) * 0.02)
    x = torch.randn(1, 4096, generator=gen, device=CUDA)
    assert pick_config(1, 6144, 4096, torch.float8_e4m3fn).fp16_operands
    assert relative_error(gemv(x, w, scale.view(-1)), gemv_reference(x, w, scale.view(-1))) < 1e-5
