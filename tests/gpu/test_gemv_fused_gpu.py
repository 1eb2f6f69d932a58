"""The fused W8A8 GEMVs (kernels/gemv_fused.py) and the fused decode layer (app/worker/layers/fused_fp8.py) on
the GPU (skipped without FP8 tensor cores): bfloat16, the Llama-3.1-8B shapes and the table's configurations.

Against the unfused kernels: the norm's sum of squares may add in another order here (an ulp of the row's
scale now and then, and a code with it), so the products agree within REL_TOL of their size (one e4m3
rounding, 2^-4, of a few codes), not bit for bit; the quantization of SiLU's products and the residual adds
are the same operations and are compared exactly where their inputs are. Under PDL in a graph the fused
chain must give the plain launches' bits.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from app.worker.layers import fused_fp8
from app.worker.model_runner import ModelRunner
from app.worker.quantization import EMULATED, gemm_backend, quantize_rows
from tests.gpu.test_fp8_gpu import prefill_logits_cuda
from tests.gpu.test_model_runner_gpu import settings
from tests.support.model_factory import build_tiny_model
from tests.support.numerics import relative_error
from tests.unit.test_model_runner import prompts_for

CUDA = torch.device("cuda", 0)
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or gemm_backend(CUDA, 64, 64) == EMULATED, reason="needs FP8 tensor cores"
)
REL_TOL = 2e-3
EPS = 1e-5
BF16 = torch.bfloat16


def fp8_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = quantize_rows(torch.randn(n, k, generator=gen, device=CUDA) * 0.02)
    return codes, scales.view(-1)


def rows(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(m, k, generator=gen, device=CUDA).to(BF16)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096)])
def test_norm_gemv_agrees_with_the_norm_then_the_gemv(m: int, n: int, k: int) -> None:
    from tokenspeed_kernels.gemv import gemv
    from tokenspeed_kernels.gemv_fused import norm_gemv
    from tokenspeed_kernels.rmsnorm import rms_norm_fp8

    gen = torch.Generator(device=CUDA).manual_seed(m)
    x, norm_weight = rows(m, k, gen), (torch.rand(k, generator=gen, device=CUDA) + 0.5).to(BF16)
    weight, scale = fp8_weight(n, k, gen)
    codes, x_scales = rms_norm_fp8(x, norm_weight, EPS)
    want = gemv(codes, weight, scale, x_scale=x_scales, out_dtype=BF16)
    assert relative_error(norm_gemv(x, norm_weight, EPS, weight, scale), want) < REL_TOL


@pytest.mark.parametrize("m", [1, 4, 16])
def test_the_fused_mlp_agrees_with_the_unfused_kernels(m: int) -> None:
    """gate_up with SiLU in its epilogue, then down quantizing the products from the partial maxima and
    adding to the residual: against the norm, gemv, silu_and_mul_fp8, gemv and the add."""
    from tokenspeed_kernels.activation import silu_and_mul
    from tokenspeed_kernels.fp8_quant import quantize_rows_with_amax
    from tokenspeed_kernels.gemv import gemv
    from tokenspeed_kernels.gemv_fused import gemv_add, norm_gemv
    from tokenspeed_kernels.rmsnorm import rms_norm_fp8

    gen = torch.Generator(device=CUDA).manual_seed(10 + m)
    hidden, inter = 4096, 14336
    x, norm_weight = rows(m, hidden, gen), (torch.rand(hidden, generator=gen, device=CUDA) + 0.5).to(BF16)
    gate_up, gate_up_scale = fp8_weight(2 * inter, hidden, gen)
    down, down_scale = fp8_weight(hidden, inter, gen)
    products, parts = norm_gemv(x, norm_weight, EPS, gate_up, gate_up_scale, gated=True)
    codes, x_scales = rms_norm_fp8(x, norm_weight, EPS)
    want = silu_and_mul(gemv(codes, gate_up, gate_up_scale, x_scale=x_scales, out_dtype=BF16))
    assert relative_error(products, want) < 10 * REL_TOL  # a code of the norm off moves many products an ulp
    got_codes, got_scales = quantize_rows_with_amax(products, parts, 64)
    assert torch.equal(got_scales, quantize_rows(products)[1])  # the partial maxima hold the row's amax
    residual = rows(m, hidden, gen)
    want = (gemv(got_codes, down, down_scale, x_scale=got_scales, out_dtype=BF16) + residual).to(BF16)
    # the same codes: the product and the add are the same operations, up to the order of the splits' sums
    assert relative_error(gemv_add(products, down, down_scale, residual.clone(), parts) - residual, want - residual) < 1e-3


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability(CUDA) < (9, 0),
                    reason="programmatic dependent launch needs compute capability 9.0")
def test_a_fused_layer_chain_under_pdl_in_a_graph_gives_the_plain_numbers() -> None:
    """Each fused GEMV loads its first weight tile before waiting for the kernel before it, then reads what
    that kernel wrote (the residual, the products and their partial maxima): PDL on must give PDL off's bits."""
    from tokenspeed_kernels.common import set_pdl
    from tokenspeed_kernels.gemv_fused import gemv_add, norm_gemv

    gen = torch.Generator(device=CUDA).manual_seed(21)
    hidden, inter = 4096, 14336
    qkv, o = fp8_weight(6144, hidden, gen), fp8_weight(hidden, hidden, gen)
    gate_up, down = fp8_weight(2 * inter, hidden, gen), fp8_weight(hidden, inter, gen)
    norm_weight = (torch.rand(hidden, generator=gen, device=CUDA) + 0.5).to(BF16)
    residual = torch.zeros(1, hidden, device=CUDA, dtype=BF16)

    def layer() -> torch.Tensor:
        q = norm_gemv(residual, norm_weight, EPS, *qkv)
        gemv_add(q[:, :hidden].contiguous(), *o, residual)
        products, parts = norm_gemv(residual, norm_weight, EPS, *gate_up, gated=True)
        gemv_add(products, *down, residual, parts)
        return q

    outputs = []
    for pdl in (False, True):
        set_pdl(pdl)
        try:
            layer()  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                qs = [layer() for _ in range(4)]
        finally:
            set_pdl(False)
        results = []
        for step in range(3):
            residual.copy_(torch.randn(1, hidden, generator=gen.manual_seed(step), device=CUDA))
            graph.replay()
            results.append(torch.cat([*(q.flatten() for q in qs), residual.flatten()]).clone())
        outputs.append(torch.stack(results))
    assert torch.equal(outputs[0], outputs[1])
    assert outputs[0].abs().sum() > 0


def test_the_fp8_model_runs_its_layers_fused_at_decode_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to fused_fp8.MAX_ROWS rows the layers run fused, with logits close to the unfused layers' and
    the same greedy tokens at nearly every position; beyond it, the unfused layers' logits exactly."""
    model_dir = build_tiny_model("llama", tmp_path, seed=5, initializer_range=0.1)
    runner = ModelRunner(settings(model_dir, quantization="fp8", block_size=4), CUDA)
    prompts = prompts_for(runner.vocab_size, [1, 5, fused_fp8.MAX_ROWS, fused_fp8.MAX_ROWS + 1])
    calls: list[int] = []
    forward_fused = type(runner.model.model.layers[0]).forward_fused
    monkeypatch.setattr(type(runner.model.model.layers[0]), "forward_fused",
                        lambda self, residual, *a: calls.append(residual.shape[0]) or forward_fused(self, residual, *a))  # fmt: skip
    fused = prefill_logits_cuda(runner, prompts)
    layers = len(runner.model.model.layers)
    assert calls == [1] * layers + [5] * layers + [fused_fp8.MAX_ROWS] * layers
    monkeypatch.setattr(fused_fp8, "MAX_ROWS", 0)
    unfused = prefill_logits_cuda(runner, prompts)
    assert len(calls) == 3 * layers
    assert torch.equal(fused[-1], unfused[-1])
    for got, want in zip(fused[:-1], unfused[:-1], strict=True):
        assert relative_error(got, want) < 2e-2
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9
    assert math.isfinite(sum(t.abs().sum().item() for t in fused))
