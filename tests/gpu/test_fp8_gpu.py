"""FP8 on CUDA (skipped without it): torch._scaled_mm against the emulated GEMM, CUDA-graph capture of an
FP8 linear, FP8 models and the FP8 KV cache through ModelRunner, and Llama-3.1-8B's weight bytes.

The row-wise _scaled_mm path needs compute capability >= 9.0 (H100/H200); on 8.9 (Ada) the
per-tensor path runs; below that everything is emulated and the _scaled_mm tests skip.
"""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import pytest
import torch
from tokenspeed_kernels.gemv import gemv, gemv_reference

from app.worker.attention import build_attention_batch, make_attention_backend
from app.worker.kv_cache import KVCache
from app.worker.layers import Linear
from app.worker.model_runner import ModelRunner
from app.worker.quantization import (
    EMULATED,
    FP8_DTYPE,
    SCALED_MM_ROWWISE,
    SCALED_MM_TENSORWISE,
    fp8_linear,
    gemm_backend,
    quantize_rows,
    quantized_layers,
)
from app.worker.quantization.fp8 import Fp8Rows
from app.worker.quantization.gemm import GEMV_MAX_ROWS
from tests.gpu.test_model_runner_gpu import LLAMA_31_8B, settings
from tests.support.model_factory import build_tiny_model, write_fp8_checkpoint
from tests.support.numerics import relative_error
from tests.unit.test_model_runner import Request, ScriptedScheduler, prompts_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda", 0)


def fp8_gemm_here() -> str:
    return gemm_backend(CUDA, 64, 64) if torch.cuda.is_available() else EMULATED


needs_scaled_mm = pytest.mark.skipif(
    not torch.cuda.is_available() or fp8_gemm_here() == EMULATED, reason="needs compute capability >= 8.9"
)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("m", "k"), [(1, 4096), (300, 14336), (8192, 4096)])
def test_fused_activation_quantization_gives_the_torch_codes(m: int, k: int, dtype: torch.dtype) -> None:
    """The W8A8 path's per-token quantization on CUDA (one Triton kernel) equals the torch ops bit for bit."""
    from tokenspeed_kernels.fp8_quant import quantize_rows as fused

    gen = torch.Generator(device=CUDA).manual_seed(m)
    x = (torch.randn(m, k, generator=gen, device=CUDA) * torch.logspace(-2, 2, m, device=CUDA).view(m, 1)).to(dtype)
    codes, scales = fused(x)
    want_codes, want_scales = quantize_rows(x)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales)


@pytest.mark.parametrize(("m", "k"), [(1, 14336), (16, 4096), (17, 4096), (512, 4096), (8192, 4096), (300, 14336)])
def test_norm_and_activation_quantize_their_output_as_quantize_rows_does(m: int, k: int) -> None:
    """The fused FP8 outputs of RMSNorm (+ residual) and SiLU-and-mul in bf16, bit for bit the unfused
    kernel followed by the per-token quantization (SiLU's spread over programs at 1, 16 and 17 rows:
    activation.SPREAD_MAX_ROWS)."""
    from tokenspeed_kernels import activation, rmsnorm

    gen = torch.Generator(device=CUDA).manual_seed(m + k)
    x = (torch.randn(m, k, generator=gen, device=CUDA) * torch.logspace(-2, 2, m, device=CUDA).view(m, 1)).bfloat16()
    residual = torch.randn(m, k, generator=gen, device=CUDA).bfloat16()
    weight = torch.rand(k, generator=gen, device=CUDA).bfloat16() + 0.5
    gate_up = torch.randn(m, 2 * k, generator=gen, device=CUDA).bfloat16() * 3

    def same(got: tuple[torch.Tensor, torch.Tensor], want: torch.Tensor) -> None:
        codes, scales = quantize_rows(want)
        assert torch.equal(got[0].view(torch.uint8), codes.view(torch.uint8)) and torch.equal(got[1], scales)

    same(rmsnorm.rms_norm_fp8(x, weight, 1e-5), rmsnorm.rms_norm(x, weight, 1e-5))
    fused_residual, unfused_residual = residual.clone(), residual.clone()
    got = rmsnorm.add_rms_norm_fp8(x, fused_residual, weight, 1e-5)
    same(got, rmsnorm.add_rms_norm(x, unfused_residual, weight, 1e-5))
    assert torch.equal(fused_residual, unfused_residual)
    same(activation.silu_and_mul_fp8(gate_up), activation.silu_and_mul(gate_up))


@needs_scaled_mm
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("static", [False, True])
def test_scaled_mm_matches_the_emulated_gemm(m: int, static: bool) -> None:
    gen = torch.Generator(device=CUDA).manual_seed(m)
    x = torch.randn(m, 256, generator=gen, device=CUDA).to(torch.bfloat16)
    w_codes, w_scale = quantize_rows(torch.randn(384, 256, generator=gen, device=CUDA))
    bias = torch.randn(384, generator=gen, device=CUDA).to(torch.bfloat16)
    input_scale = (x.abs().max().float() / 448).reshape(()) if static else None
    args = (x, w_codes, w_scale.view(1, -1), input_scale, bias)
    backend = fp8_gemm_here()
    if torch.cuda.get_device_capability(CUDA) >= (9, 0):
        assert backend == SCALED_MM_ROWWISE
    got = fp8_linear(*args, backend)  # decode sizes (m <= GEMV_MAX_ROWS): the W8A8 GEMV
    want = fp8_linear(*args, EMULATED)
    assert got.dtype == torch.bfloat16 and got.shape == (m, 384)
    assert relative_error(got, want) < 1e-2  # bf16 outputs, different summation order


@needs_scaled_mm
@pytest.mark.parametrize(("m", "n", "k"), [(1, 6144, 4096), (4, 4096, 14336), (16, 1000, 200)])
def test_fp8_gemv_in_bf16_matches_float64(m: int, n: int, k: int) -> None:
    gen = torch.Generator(device=CUDA).manual_seed(n)
    w_codes, w_scale = quantize_rows(torch.randn(n, k, generator=gen, device=CUDA) * 0.02)
    x = torch.randn(m, k, generator=gen, device=CUDA).to(torch.bfloat16)
    got = gemv(x, w_codes, w_scale.view(-1))
    assert relative_error(got, gemv_reference(x, w_codes, w_scale.view(-1))) < 1e-2


@needs_scaled_mm
def test_tensorwise_path_matches_too() -> None:
    gen = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(33, 128, generator=gen, device=CUDA).to(torch.bfloat16)
    w_codes, w_scale = quantize_rows(torch.randn(64, 128, generator=gen, device=CUDA))
    args = (x, w_codes, w_scale.view(1, -1), None, None)
    assert relative_error(fp8_linear(*args, SCALED_MM_TENSORWISE), fp8_linear(*args, EMULATED)) < 1e-2


@needs_scaled_mm
def test_fp8_linear_is_captured_by_a_cuda_graph() -> None:
    """No host synchronisation on the path: decode steps run as CUDA graphs."""
    gen = torch.Generator(device=CUDA).manual_seed(1)
    x = torch.randn(8, 256, generator=gen, device=CUDA).to(torch.bfloat16)
    w_codes, w_scale = quantize_rows(torch.randn(512, 256, generator=gen, device=CUDA))
    backend = fp8_gemm_here()
    fp8_linear(x, w_codes, w_scale.view(1, -1), None, None, backend)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, w_codes, w_scale.view(1, -1), None, None, backend)
    x.copy_(torch.randn(8, 256, generator=gen, device=CUDA).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8_linear(x, w_codes, w_scale.view(1, -1), None, None, backend))


def test_fp8_model_on_cuda_uses_scaled_mm_and_matches_the_emulated_path(tmp_path: Path) -> None:
    model_dir = build_tiny_model("qwen3", tmp_path, seed=5, initializer_range=0.1)
    runner = ModelRunner(settings(model_dir, quantization="fp8", block_size=4), CUDA)
    layers = [layer for _, layer in quantized_layers(runner.model)]
    assert all(layer.weight.dtype == FP8_DTYPE and layer.fp8_backend == fp8_gemm_here() for layer in layers)
    prompts = prompts_for(runner.vocab_size, [9, 30])
    fast = torch.cat(prefill_logits_cuda(runner, prompts))
    for layer in layers:
        layer.fp8_backend = EMULATED
    emulated = torch.cat(prefill_logits_cuda(runner, prompts))
    # Not tight: FP8 activation rounding is discontinuous, so bf16 summation-order noise flips some codes
    # and the random model amplifies that (two bf16 implementations differ by ~9% on the CPU). A wrong
    # operand layout or scale would be off by 100% or more.
    assert relative_error(fast, emulated) < 0.2
    for layer in layers:
        layer.fp8_backend = gemm_backend(CUDA, layer.weight.shape[1], layer.weight.shape[0])
    runner.warmup()
    sched = ScriptedScheduler(runner)
    for i, prompt in enumerate(prompts):
        sched.add(Request(f"r{i}", prompt, max_new=16, join_step=i))
    assert [len(v) for v in sched.run().values()] == [16, 16]


@needs_scaled_mm
def test_fp8_model_hands_quantized_rows_over_with_the_same_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Norms and SiLU-and-mul quantizing their outputs for the FP8 GEMMs (cuBLAS beyond GEMV_MAX_ROWS
    rows, the W8A8 GEMV up to it) give the logits of quantizing inside each linear, bit for bit."""
    model_dir = build_tiny_model("llama", tmp_path, seed=5, initializer_range=0.1)
    runner = ModelRunner(settings(model_dir, quantization="fp8", block_size=4), CUDA)
    prompts = prompts_for(runner.vocab_size, [3, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 60])
    inputs: list[bool] = []
    project = Linear.project
    monkeypatch.setattr(Linear, "project", lambda self, x, bias: inputs.append(isinstance(x, Fp8Rows))
                        or project(self, x, bias))  # fmt: skip
    handed_over = torch.cat(prefill_logits_cuda(runner, prompts))
    assert sum(inputs) == 3 * len(inputs) // 4  # all but o_proj's
    monkeypatch.setattr(Linear, "takes_quantized_rows", lambda self: False)
    inputs.clear()
    assert torch.equal(handed_over, torch.cat(prefill_logits_cuda(runner, prompts)))
    assert inputs and not any(inputs)


def prefill_logits_cuda(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All-position logits of each prompt (one prefill each, torch attention over a cache like the
    runner's), on the CPU."""
    model, out = runner.model, []
    for prompt in prompts:
        blocks = math.ceil(len(prompt) / 4)
        cache = KVCache(model.kv_cache_spec(runner.kv_dtype), blocks, 4, CUDA, runner.kv_quant.k_scales,
                        runner.kv_quant.v_scales)  # fmt: skip
        backend = make_attention_backend("torch", cache, model.attention_spec)
        table = torch.arange(blocks, dtype=torch.int32, device=CUDA).unsqueeze(0)
        batch = build_attention_batch(table, [len(prompt)], [len(prompt)], 4)
        with torch.no_grad():
            hidden = model(torch.tensor(prompt, device=CUDA), batch.positions, backend.plan(batch))
            out.append(model.compute_logits(hidden).cpu())
    return out


def test_fp8_block_checkpoint_on_cuda(tmp_path: Path) -> None:
    dims = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "intermediate_size": 384, "num_hidden_layers": 2}  # fmt: skip
    model_dir = build_tiny_model("qwen3", tmp_path / "f", seed=5, initializer_range=0.1, **dims)
    ckpt = write_fp8_checkpoint(model_dir, tmp_path / "b", "fp8-block")
    full = ModelRunner(settings(model_dir, block_size=4), CUDA)
    fp8 = ModelRunner(settings(ckpt, block_size=4), CUDA)
    assert fp8.ready_message().info["quantization"].startswith("fp8 (e4m3 weights: checkpoint FP8, 128x128")
    assert fp8.weights_bytes < full.weights_bytes
    prompts = prompts_for(full.vocab_size, [17, 40])
    got = torch.cat(prefill_logits_cuda(fp8, prompts))
    assert relative_error(got, torch.cat(prefill_logits_cuda(full, prompts))) < 0.3  # 0.25 on the CPU, + bf16


def pool_tokens(model_dir: Path, **overrides: object) -> int:
    """The KV pool one runner gets, sized alone on the GPU (a live runner's pool would count as used)."""
    runner = ModelRunner(settings(model_dir, **overrides), CUDA)
    tokens = runner.pool.tokens
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return tokens


def test_fp8_kv_cache_on_cuda_doubles_the_pool(tmp_path: Path) -> None:
    model_dir = build_tiny_model("llama", tmp_path, seed=2, initializer_range=0.1)
    common = {"max_total_tokens": None, "gpu_memory_utilization": 0.1, "block_size": 16}
    ratio = pool_tokens(model_dir, kv_cache_dtype="fp8_e4m3", **common) / pool_tokens(model_dir, **common)
    assert 1.8 < ratio < 2.2, ratio  # the same KV bytes, half the bytes per token
    fp8 = ModelRunner(settings(model_dir, kv_cache_dtype="fp8_e4m3"), CUDA)
    assert fp8.kv_cache.k[0].dtype == FP8_DTYPE
    assert fp8.attention.name == "torch" or getattr(type(fp8.attention), "supports_fp8_kv", False)
    fp8.warmup()
    sched = ScriptedScheduler(fp8)
    sched.add(Request("r", prompts_for(fp8.vocab_size, [20])[0], max_new=16))
    assert len(sched.run()["r"]) == 16


def test_llama_8b_fp8_weights_take_about_half_the_bytes(tmp_path: Path) -> None:
    """Dummy Llama-3.1-8B: FP8 decoder linears (7.0e9 values, 1 byte) + bf16 embeddings and LM head
    (2 x 128256 x 4096 x 2 bytes) ~ 9.1 GB, against 16.06 GB in bf16."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    runner = ModelRunner(
        settings(
            tmp_path,
            load_format="dummy",
            quantization="fp8",
            max_model_len=4096,
            max_total_tokens=None,
            gpu_memory_utilization=0.5,
            max_num_seqs=32,
            chunked_prefill_size=4096,
        ),  # fmt: skip
        CUDA,
    )
    info = runner.ready_message().info
    assert 8.8 < info["weights_gb"] < 9.4, info
    assert info["quantization"].startswith("fp8 (e4m3 weights: quantized at load")
    runner.warmup()
