"""kernels/moe.py on CUDA (skipped without it), in bfloat16 (the interpreter has none), on the Qwen3-30B-A3B
layer shape and a ragged one: the router against its reference (same ids, weights to float32 rounding),
both expert shapes (per-pair GEMV, grouped GEMM) with 16-bit and FP8 weights against the float64
dequantized reference, and the MoE block captured in a CUDA graph replaying what eager computes."""

from __future__ import annotations

import pytest
import torch
from tokenspeed_kernels.moe import (
    MoeDecodeConfig,
    fused_moe,
    moe_align,
    moe_align_reference,
    route_linear_topk,
    route_topk,
    route_topk_reference,
)

from app.worker.layers.moe import MoeSpec, SparseMoeBlock
from app.worker.quantization import quantize_rows
from tests.support.numerics import relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda", 0)
# (experts, top_k, hidden, expert intermediate): Qwen3-30B-A3B, Mixtral's routing on a small layer, ragged
SHAPES = [(128, 8, 2048, 768), (8, 2, 1024, 512), (6, 3, 200, 72)]


def experts(e: int, h: int, inter: int, fp8: bool):
    g = torch.Generator(device=CUDA).manual_seed(0)
    w13 = torch.randn(e, 2 * inter, h, device=CUDA, generator=g) * h**-0.5
    w2 = torch.randn(e, h, inter, device=CUDA, generator=g) * inter**-0.5
    if not fp8:
        return w13.bfloat16(), w2.bfloat16(), None, None
    (c13, s13), (c2, s2) = (quantize_rows(w.reshape(-1, w.shape[-1])) for w in (w13, w2))
    return c13.view(w13.shape), c2.view(w2.shape), s13.view(e, -1), s2.view(e, -1)


def reference64(x, w13, w2, weights, ids, s13, s2) -> torch.Tensor:  # noqa: ANN001
    """float64 over the dequantized weights, expert by expert."""
    d13 = w13.double() if s13 is None else w13.double() * s13.double()[..., None]
    d2 = w2.double() if s2 is None else w2.double() * s2.double()[..., None]
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (d13[e] @ x[t].double()).chunk(2)
            out[t] += float(weights[t, j]) * (d2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize(("e", "k", "h", "inter"), SHAPES)
def test_router_matches_reference(e: int, k: int, h: int, inter: int) -> None:
    logits = torch.randn(37, e, device=CUDA).bfloat16()
    weights, ids = route_topk(logits, k, renormalize=True)
    ref_w, ref_ids = route_topk_reference(logits, k, renormalize=True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("e", "k", "h", "inter"), SHAPES)
def test_router_linear_in_one_launch_picks_a_top_k(e: int, k: int, h: int, inter: int) -> None:
    """route_linear_topk against the float32 linear: its logits are rounded to bf16 after a sum in another
    order than cuBLAS's, so a near-tie may go either way; every pick must be a top-k up to that rounding,
    and the weights the softmax at the picks."""
    x = torch.randn(16, h, device=CUDA).bfloat16()
    w = (torch.randn(e, h, device=CUDA) * h**-0.5).bfloat16()
    weights, ids = route_linear_topk(x, w, k, renormalize=True)
    exact = x.float() @ w.float().T
    kth = exact.topk(k, dim=-1).values[:, -1:]
    tol = 2 * (exact.abs().amax(-1, keepdim=True) * 2**-8)  # two bf16 ulps of the largest logit
    assert (exact.gather(1, ids.long()) >= kth - tol).all()
    assert all(len(set(r)) == k for r in ids.tolist())  # k distinct experts a token
    p = torch.softmax(exact.bfloat16().float(), -1).gather(1, ids.long())
    torch.testing.assert_close(weights, p / p.sum(-1, keepdim=True), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("tokens", [1, 4, 300, "dot 1", "dot 4"],
                         ids=["decode 1", "decode 4", "grouped 300", "decode 1 tensor cores", "decode 4 tensor cores"])  # fmt: skip
@pytest.mark.parametrize(("e", "k", "h", "inter"), SHAPES)
def test_fused_moe_matches_float64(e: int, k: int, h: int, inter: int, tokens: int | str, fp8: bool) -> None:
    """The default path (the kept table's tiles where measured), and the decode GEMVs' tensor-core form
    forced with the down kernel's pairs over 2 programs where k is even (the tuning may pick both)."""
    config = MoeDecodeConfig(block_n=16, block_k=128, use_dot=True, pair_split=2) if isinstance(tokens, str) else None
    tokens = int(str(tokens).split()[-1])
    w13, w2, s13, s2 = experts(e, h, inter, fp8)
    x = torch.randn(tokens, h, device=CUDA).bfloat16()
    weights, ids = route_topk(torch.randn(tokens, e, device=CUDA), k, renormalize=True)
    out = fused_moe(x, w13, w2, weights, ids, s13, s2, decode=True if config else None, config=config)
    assert relative_error(out, reference64(x, w13, w2, weights, ids, s13, s2)) < 1e-2  # bf16 x and output


def test_both_shapes_agree() -> None:
    w13, w2, _, _ = experts(16, 256, 128, False)
    x = torch.randn(8, 256, device=CUDA).bfloat16()
    weights, ids = route_topk(torch.randn(8, 16, device=CUDA), 4, renormalize=False)
    a = fused_moe(x, w13, w2, weights, ids, decode=True)
    b = fused_moe(x, w13, w2, weights, ids, decode=False)
    assert relative_error(a, b) < 1e-2


@pytest.mark.parametrize(("tokens", "block_m"), [(1, 16), (100, 16), (512, 64)])
def test_align_kernel_equals_the_torch_reference(tokens: int, block_m: int) -> None:
    ids = torch.stack([torch.randperm(128, device=CUDA)[:8] for _ in range(tokens)]).to(torch.int32)
    got, want = moe_align(ids, 128, block_m), moe_align_reference(ids, 128, block_m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_align_has_no_host_sync_and_covers_every_pair() -> None:
    ids = torch.randint(0, 128, (300, 8), device=CUDA, dtype=torch.int32)
    torch.cuda.set_sync_debug_mode("error")
    try:
        sorted_ids, block_expert = moe_align(ids, 128, 64)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    real = sorted_ids[sorted_ids < ids.numel()].sort().values
    assert torch.equal(real, torch.arange(ids.numel(), device=CUDA, dtype=torch.int32))


@pytest.mark.parametrize("tokens", [1, 8, 100])  # the router in one launch at 1 and 8, linear then route at 100
def test_cuda_graph_replays_eager(tokens: int) -> None:
    spec = MoeSpec(num_experts=128, top_k=8, intermediate=768, renormalize=True)
    with torch.device(CUDA):
        block = SparseMoeBlock(2048, spec, torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(tokens, 2048, device=CUDA).bfloat16()
    with torch.no_grad():
        eager = block(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            block(x)  # warm-up (compiles) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = block(x)
        x.copy_(x.flip(0))
        graph.replay()
        torch.testing.assert_close(captured, block(x), rtol=0, atol=0)
    assert eager.shape == (tokens, 2048)


def test_cuda_bfloat16_logits_close_to_transformers(tmp_path) -> None:  # noqa: ANN001
    """bf16: the first greedy token is (near) transformers' best, the dense models' tolerance."""
    from app.protocol import NewSeq, SamplingParams, SeqChunk, StepPlan
    from app.worker.model_runner import ModelRunner
    from tests.gpu.test_model_runner_gpu import settings
    from tests.support.model_factory import build_tiny_model
    from tests.unit.test_model_runner import hf_model, prompts_for

    model_dir = build_tiny_model("qwen3_moe", tmp_path, seed=3)
    runner = ModelRunner(settings(model_dir), CUDA)
    prompt = prompts_for(runner.vocab_size, [20])[0]
    plan = StepPlan(step=0, new_seqs=[NewSeq(0, "a", SamplingParams(temperature=0.0), 20, [0, 1])],
                    chunks=[SeqChunk(0, prompt)])  # fmt: skip
    first = runner.execute(plan).token_ids[0]
    reference = hf_model(model_dir, "cuda", torch.bfloat16)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
    assert logits.max() - logits[first] <= 0.05 * logits.abs().max()
