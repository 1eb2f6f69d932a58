"""Each attention backend and the CUDA-graph path on the GPU (skipped without CUDA).

- float32 tiny models: greedy output equals transformers' (torch and triton; flashinfer has no fp32);
- bfloat16 tiny model, every backend: the logits of every sampled position (prefills, then graphed
  decodes) within TINY_REL_TOL of transformers' on the same tokens (relative L2 per row);
- graphs vs eager: identical tokens when every batch size is a captured size (no pad rows change
  the GEMM shapes) for triton and flashinfer; prefill and mixed steps in graph pieces (padded to
  their token bucket) give the eager steps' logits within PIECES_REL_TOL;
- kernels on CUDA against their torch references (the interpreter tests' twins);
- Llama-3.1-8B shape, bf16 dummy weights shared with transformers: logits of a batch of prompts
  (prefill, then graphed decodes) within twice transformers' own bf16 error (against its float32
  copy), or LOGITS_REL_TOL if larger (relative L2 per row).
"""

from __future__ import annotations

import copy
import gc
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from app.protocol import NewSeq, SamplingParams, SeqChunk, StepPlan
from app.worker.model_runner import ModelRunner
from tests.gpu.test_model_runner_gpu import LLAMA_31_8B, settings
from tests.support.model_factory import build_tiny_model
from tests.unit.test_model_runner import Request, ScriptedScheduler, hf_greedy, hf_model, prompts_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda", 0)
TINY_REL_TOL = 0.05
LOGITS_REL_TOL = 0.05
PIECES_REL_TOL = 0.02  # bf16: the padded GEMMs may sum in another order
FP8 = torch.float8_e4m3fn
# Attention with FP8 queries (xqa's decode, FA3's prefill over an FP8 cache): e4m3 keeps 3 mantissa bits,
# so a rounded query is off by ~3.6% rms; the outputs measured 4.3e-2 to 5.4e-2 on random data.
FP8_QUERY_BOUND = 8e-2


def _has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


BACKENDS = ["torch", "triton", pytest.param("flashinfer", marks=pytest.mark.skipif(not _has_flashinfer(),
                                                                                    reason="no flashinfer"))]  # fmt: skip


@pytest.fixture(autouse=True)
def free_gpu_memory() -> Iterator[None]:
    """Runners hold weights, KV cache and graphs: release them before the next test sizes its pool."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def run_requests(runner: ModelRunner, prompts: list[list[int]], new: int) -> dict[str, list[int]]:
    sched = ScriptedScheduler(runner)
    for i, prompt in enumerate(prompts):
        sched.add(Request(f"r{i}", prompt, max_new=new, join_step=3 * i))
    return sched.run()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_float32_greedy_parity(backend: str, arch: str, tmp_path: Path) -> None:
    model_dir = build_tiny_model(arch, tmp_path, seed=2)
    runner = ModelRunner(settings(model_dir, dtype="float32", block_size=4, attention_backend=backend), CUDA)
    assert runner.ready_message().info["attention_backend"] == backend
    assert (runner.graphs is not None) == (backend != "torch")
    runner.warmup()
    prompts = prompts_for(runner.vocab_size, [5, 41, 12])
    outputs = run_requests(runner, prompts, 32)
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(model_dir, prompt, 32, device="cuda"), f"r{i}"


def logits_errors(runner: ModelRunner, reference: Any, prompts: list[list[int]], new: int) -> list[float]:
    """Run the prompts (greedy, `new` tokens each), keeping the logits of every sampled position; then
    the worst relative L2 error per prompt against the reference model fed the same tokens."""
    seen: dict[str, list[torch.Tensor]] = {}  # request -> logits of its sampled positions, in order
    sample = runner.sampler.sample
    sched = ScriptedScheduler(runner)

    def spy(logits: torch.Tensor, slots: list[int]) -> Any:
        running = {
            r.slot: r.rid for r in sched.requests.values() if r.registered and len(r.output) < r.max_new
        }
        for row, slot in enumerate(slots):  # slots are reused: map each to the request running in it
            seen.setdefault(running[slot], []).append(logits[row].clone())
        return sample(logits, slots)

    runner.sampler.sample = spy
    for i, prompt in enumerate(prompts):
        sched.add(Request(f"r{i}", prompt, max_new=new, join_step=2 * i))
    outputs = sched.run()
    errors = []
    for i, prompt in enumerate(prompts):
        ours = torch.stack(seen[f"r{i}"])
        with torch.no_grad():
            ref = reference(torch.tensor([prompt + outputs[f"r{i}"]], device="cuda")).logits[0].float()
        ref = ref[len(prompt) - 1 : len(prompt) - 1 + len(ours)]
        errors.append(((ours - ref).norm(dim=1) / ref.norm(dim=1)).max().item())
    return errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_logits_close_to_transformers(backend: str, tmp_path: Path) -> None:
    # head_dim 128: the flashinfer kernels JIT-compiled for the 8B shape serve this model too.
    model_dir = build_tiny_model("llama", tmp_path, seed=4, head_dim=128, initializer_range=0.1)
    runner = ModelRunner(settings(model_dir, dtype="bfloat16", attention_backend=backend), CUDA)
    prompts = prompts_for(runner.vocab_size, [7, 70, 19])
    errors = logits_errors(runner, hf_model(model_dir, "cuda", torch.bfloat16), prompts, 24)
    print(f"tiny bf16 {backend}: logits relative L2 error, worst position per prompt: {errors}")
    assert max(errors) < TINY_REL_TOL


@pytest.mark.parametrize("backend", ["triton", pytest.param("flashinfer", marks=BACKENDS[2].marks)])
def test_graph_and_eager_give_identical_tokens(backend: str, tmp_path: Path) -> None:
    model_dir = build_tiny_model("llama", tmp_path, seed=6, head_dim=128)
    common = {"dtype": "bfloat16", "attention_backend": backend, "max_num_seqs": 4}
    graphed = ModelRunner(
        settings(model_dir, cudagraph_capture_sizes=[1, 2, 3, 4], piecewise_cuda_graph_max_tokens=0, **common), CUDA
    )
    eager = ModelRunner(settings(model_dir, enforce_eager=True, **common), CUDA)
    assert graphed.graphs is not None and eager.graphs is None
    prompts = prompts_for(graphed.vocab_size, [9, 33, 4, 17], seed=3)
    assert run_requests(graphed, prompts, 40) == run_requests(eager, prompts, 40)


def step_logits(runner: ModelRunner, plan: StepPlan) -> torch.Tensor:
    """The logits of the rows the step samples."""
    seen: list[torch.Tensor] = []
    sample = runner.sampler.sample
    runner.sampler.sample = lambda logits, slots: (seen.append(logits.float().clone()), sample(logits, slots))[1]
    try:
        runner.execute(plan)
    finally:
        runner.sampler.sample = sample
    return seen[0]


@pytest.mark.parametrize("backend", ["triton", pytest.param("flashinfer", marks=BACKENDS[2].marks)])
def test_piecewise_graphs_give_the_eager_logits(backend: str, tmp_path: Path) -> None:
    model_dir = build_tiny_model("llama", tmp_path, seed=6, head_dim=128, initializer_range=0.1)
    common = {"dtype": "bfloat16", "attention_backend": backend, "max_num_seqs": 4, "chunked_prefill_size": 64}
    pieced = ModelRunner(settings(model_dir, **common), CUDA)
    eager = ModelRunner(settings(model_dir, piecewise_cuda_graph_max_tokens=0, **common), CUDA)
    assert pieced.pieces is not None and pieced.pieces.sizes == [16, 32, 64] and eager.pieces is None
    replays = []
    run = pieced.pieces.run
    pieced.pieces.run = lambda *args: (replays.append(args[1].num_tokens), run(*args))[1]
    a, b, c = prompts_for(pieced.vocab_size, [33, 17, 60], seed=5)
    greedy = SamplingParams(temperature=0.0)
    plans = [  # a prefill (bucket 64), then a one-token extend beside a prefill (18 tokens: bucket 32)
        StepPlan(step=0, new_seqs=[NewSeq(0, "a", greedy, 33, [0, 1, 2])], chunks=[SeqChunk(0, a)]),
        StepPlan(step=1, new_seqs=[NewSeq(1, "b", greedy, 17, [3, 4])], chunks=[SeqChunk(0, [5]), SeqChunk(1, b)]),
        # a prompt that fills its bucket exactly, beside two more extends of one token
        StepPlan(step=2, new_seqs=[NewSeq(2, "c", greedy, 60, [5, 6, 7, 8])],
                 chunks=[SeqChunk(0, [6]), SeqChunk(1, [7]), SeqChunk(2, c)]),
    ]  # fmt: skip
    for plan in plans:
        ours, reference = step_logits(pieced, plan), step_logits(eager, plan)
        error = ((ours - reference).norm(dim=1) / reference.norm(dim=1)).max().item()
        print(f"{backend} step {plan.step}: relative L2 error {error:.2e}")
        assert error < PIECES_REL_TOL, plan.step
    assert replays == [33, 18, 62]


def test_kernels_on_cuda_match_references() -> None:
    from tokenspeed_kernels import activation, decode_attention, prefill_attention, rmsnorm, rotary

    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(40, 16, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(40, 16, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(40, device="cuda", generator=gen).int().view(2, 20)
    seq_lens = torch.tensor([300, 17], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = decode_attention.paged_decode_attention_reference(q, k, v, table, seq_lens, 128**-0.5)
    for splits in (7, 1):  # one piece: the split kernel writes the output, no merge
        out = decode_attention.paged_decode_attention(q, k, v, table, seq_lens, 128**-0.5, splits)
        assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
    cu = torch.tensor([0, 100, 117], dtype=torch.int32, device="cuda")
    qp = torch.randn(117, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = prefill_attention.paged_prefill_attention(qp, k, v, table, cu, seq_lens, 100, 128**-0.5)
    ref = prefill_attention.paged_prefill_attention_reference(qp, k, v, table, cu, seq_lens, 128**-0.5)
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
    x = torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    torch.testing.assert_close(rmsnorm.rms_norm(x, w, 1e-5), rmsnorm.rms_norm_reference(x, w, 1e-5))
    gu = torch.randn(5, 2 * 14336, device="cuda", dtype=torch.bfloat16, generator=gen)
    torch.testing.assert_close(activation.silu_and_mul(gu), activation.silu_and_mul_reference(gu))
    cos, sin = (
        torch.randn(64, 64, device="cuda", generator=gen),
        torch.randn(64, 64, device="cuda", generator=gen),
    )
    for tokens in (2, 40):  # one head a program, then several
        qr = torch.randn(tokens, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        kr = torch.randn(tokens, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        pos = torch.randint(0, 64, (tokens,), device="cuda", generator=gen)
        ref_q, ref_k = rotary.rotary_reference(qr, kr, cos, sin, pos)
        rotary.rotary_inplace(qr, kr, cos, sin, pos)
        # bf16 on CUDA: rounding differs from torch's by an ulp, and x*cos - y*sin cancels, so an
        # element near 0 can be an ulp of its operands (|x| ~ 1: 2**-7) away; a wrong rotation is O(1) off.
        torch.testing.assert_close(qr, ref_q, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(kr, ref_k, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tokens", [5, 40])  # one head a program, then several
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_fused_rotary_and_kv_write_on_cuda_equal_the_two_kernels(kv_dtype: torch.dtype, tokens: int) -> None:
    """rotate_and_write_kv on the GPU compiler's code: the bits of rotary_inplace then write_kv."""
    from tokenspeed_kernels import kv_write, rotary

    gen = torch.Generator(device="cuda").manual_seed(1)
    scales = {"k_scale": 0.5, "v_scale": 0.25} if kv_dtype == torch.float8_e4m3fn else {}
    cos, sin = torch.randn(256, 64, device="cuda", generator=gen), torch.randn(256, 64, device="cuda", generator=gen)
    qkv = torch.randn(tokens, 48 * 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    pos = torch.randint(0, 256, (tokens,), device="cuda", generator=gen)
    slots = torch.randperm(128, device="cuda", generator=gen)[:tokens]
    results = []
    for fused in (True, False):
        x, caches = qkv.clone(), [torch.zeros(8, 16, 8, 128, device="cuda").to(kv_dtype) for _ in range(2)]
        xq = x[:, :4096].view(tokens, 32, 128)
        xk, xv = x[:, 4096:5120].view(tokens, 8, 128), x[:, 5120:].view(tokens, 8, 128)
        if fused:
            rotary.rotate_and_write_kv(xq, xk, xv, cos, sin, pos, *caches, slots, *scales.values())
        else:
            rotary.rotary_inplace(xq, xk, cos, sin, pos)
            kv_write.write_kv(xk, xv, *caches, slots, *scales.values())
        results.append([x, *(c.view(torch.uint8) for c in caches)])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    x, caches = qkv.clone(), [torch.zeros(8, 16, 8, 128, device="cuda").to(kv_dtype) for _ in range(2)]
    q_out = torch.empty(tokens, 32, 128, device="cuda", dtype=torch.bfloat16)
    xk, xv = x[:, 4096:5120].view(tokens, 8, 128), x[:, 5120:].view(tokens, 8, 128)
    rotary.rotate_and_write_kv(x[:, :4096].view(tokens, 32, 128), xk, xv, cos, sin, pos, *caches, slots,
                               *scales.values(), q_out=q_out)  # fmt: skip
    assert torch.equal(q_out, results[0][0][:, :4096].view(tokens, 32, 128)) and torch.equal(x[:, :4096], qkv[:, :4096])
    assert all(torch.equal(c.view(torch.uint8), r) for c, r in zip(caches, results[0][1:], strict=True))


@pytest.mark.skipif(not _has_flashinfer(), reason="no flashinfer")
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("decode_kernel", ["triton", "tensor_cores", "cuda_cores", "xqa"])
def test_flashinfer_decode_kernels_match_the_torch_backend(decode_kernel: str, kv_dtype: torch.dtype) -> None:
    """Each decode kernel the flashinfer backend can run, eager and captured in a CUDA graph, on a 16-bit
    and an FP8 cache with scales; and a mixed step (decodes first, then prefill chunks), whose decode
    rows run that kernel and the rest the prefill wrapper. xqa on an FP8 cache rounds the query to FP8
    as well (3 mantissa bits where bfloat16 has 7), so its bound there is wider; so do the prefill rows
    of a mixed step over an FP8 cache (FA3 with FP8 queries on Hopper)."""
    from app.worker.attention import AttentionSpec, build_attention_batch
    from app.worker.attention.flashinfer_backend import FlashInferAttentionBackend
    from app.worker.attention.torch_backend import TorchAttentionBackend
    from app.worker.kv_cache import KVCache, KVCacheSpec

    gen = torch.Generator(device="cuda").manual_seed(0)
    scales = {"k_scales": [0.5], "v_scales": [2.0]} if kv_dtype == torch.float8_e4m3fn else {}
    cache = KVCache(KVCacheSpec(1, 8, 128, kv_dtype), 64, 16, CUDA, **scales)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, device=CUDA, generator=gen).to(kv_dtype))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, device=CUDA, generator=gen).to(kv_dtype))
    spec = AttentionSpec(32, 8, 128, 128**-0.5, q_dtype=torch.bfloat16)
    tables = torch.randperm(63, device=CUDA, generator=gen)[:60].int().view(3, 20)
    batch = build_attention_batch(tables, [1, 1, 1], [300, 17, 129], 16)
    q = torch.randn(3, 32, 128, device=CUDA, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(3, 8, 128, device=CUDA, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    reference = TorchAttentionBackend(cache, spec)
    expected = reference.forward(0, q, k, v, reference.plan(batch)).float()
    if decode_kernel == "tensor_cores" and kv_dtype == torch.bfloat16:
        with pytest.raises(ValueError, match="'tensor_cores' serves an FP8 cache"):
            FlashInferAttentionBackend(cache, spec, decode_kernel=decode_kernel)
        return
    bound = 5e-2 if decode_kernel == "xqa" and kv_dtype == torch.float8_e4m3fn else 2e-2
    backend = FlashInferAttentionBackend(cache, spec, decode_kernel=decode_kernel)
    eager = backend.forward(0, q, k, v, backend.plan(batch)).float()
    meta = backend.capture_metadata(batch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = backend.forward(0, q, k, v, meta)
    graph.replay()
    for out in (eager, captured.float()):
        error = float((out - expected).norm() / expected.norm())
        print(f"{decode_kernel} {kv_dtype}: relative error {error:.2e}")
        assert error < bound
    mixed = build_attention_batch(tables, [1, 40, 7], [300, 57, 129], 16)
    qm = torch.randn(48, 32, 128, device=CUDA, dtype=torch.bfloat16, generator=gen)
    km, vm = (torch.randn(48, 8, 128, device=CUDA, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    expected = reference.forward(0, qm, km, vm, reference.plan(mixed)).float()
    meta = backend.plan(mixed)
    assert type(meta).__name__ == "MixedMetadata" and meta.decode_tokens == 1
    out = backend.forward(0, qm, km, vm, meta).float()
    assert float((out - expected).norm() / expected.norm()) < (FP8_QUERY_BOUND if kv_dtype == FP8 else bound)
    default = "xqa" if kv_dtype == torch.float8_e4m3fn else "triton"  # the faster per cache dtype on Hopper
    assert FlashInferAttentionBackend(cache, spec).decode_kernel == default


@pytest.mark.skipif(not _has_flashinfer(), reason="no flashinfer")
@pytest.mark.parametrize("prefill_kernel", ["fa2", "fa3"])
def test_flashinfer_prefill_over_an_fp8_cache_matches_the_torch_backend(prefill_kernel: str) -> None:
    """Prefill chunks over an FP8 cache with scales (a fresh prompt, a chunk after a cached prefix, one
    token): FA2 with bf16 queries, and FA3 with the queries rounded to FP8 (the default on Hopper),
    within their bounds of the torch backend; a wrong scale or mask is off by O(1)."""
    from app.worker.attention import AttentionSpec, build_attention_batch
    from app.worker.attention.flashinfer_backend import FlashInferAttentionBackend
    from app.worker.attention.torch_backend import TorchAttentionBackend
    from app.worker.kv_cache import KVCache, KVCacheSpec

    gen = torch.Generator(device="cuda").manual_seed(5)
    cache = KVCache(KVCacheSpec(1, 8, 128, FP8), 64, 16, CUDA, k_scales=[0.5], v_scales=[2.0])
    cache.k[0].copy_(torch.randn(cache.k[0].shape, device=CUDA, generator=gen).to(FP8))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, device=CUDA, generator=gen).to(FP8))
    spec = AttentionSpec(32, 8, 128, 128**-0.5, q_dtype=torch.bfloat16)
    tables = torch.randperm(63, device=CUDA, generator=gen)[:60].int().view(3, 20)
    batch = build_attention_batch(tables, [200, 60, 1], [200, 260, 90], 16)
    q = torch.randn(261, 32, 128, device=CUDA, dtype=torch.bfloat16, generator=gen) * 2
    k, v = (torch.randn(261, 8, 128, device=CUDA, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    reference = TorchAttentionBackend(cache, spec)
    expected = reference.forward(0, q, k, v, reference.plan(batch)).float()
    backend = FlashInferAttentionBackend(cache, spec, prefill_kernel=prefill_kernel)
    assert backend.prefill_q_dtype == (FP8 if prefill_kernel == "fa3" else torch.bfloat16)
    out = backend.forward(0, q, k, v, backend.plan(batch))
    assert out.dtype == torch.bfloat16
    error = float((out.float() - expected).norm() / expected.norm())
    print(f"prefill {prefill_kernel} over an FP8 cache: relative error {error:.2e}")
    assert error < (FP8_QUERY_BOUND if prefill_kernel == "fa3" else 2e-2)
    assert FlashInferAttentionBackend(cache, spec).prefill_kernels == "fa3"  # the default on Hopper


@pytest.fixture(scope="module")
def llama_8b(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, float]:
    """The 8B shape in transformers (bf16, random weights) and its own bf16 error: the worst relative L2
    distance of its logits from a float32 copy's over the test's prompts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = tmp_path_factory.mktemp("llama8b")
    (model_dir / "config.json").write_text(json.dumps(LLAMA_31_8B))
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    exact = copy.deepcopy(hf).float()
    floor = 0.0
    with torch.no_grad():
        for prompt in prompts_for(LLAMA_31_8B["vocab_size"], PROMPTS_8B, seed=8):
            ids = torch.tensor([prompt], device="cuda")
            ours, ref = hf(ids).logits[0].float(), exact(ids).logits[0]
            floor = max(floor, ((ours - ref).norm(dim=1) / ref.norm(dim=1)).max().item())
    del exact
    torch.cuda.empty_cache()
    return model_dir, hf, floor


PROMPTS_8B = [100, 37, 260, 5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_llama_8b_logits_close_to_transformers(backend: str, llama_8b: tuple[Path, Any, float]) -> None:
    """Two bf16 implementations of 32 layers differ by about sqrt(2) times each one's distance from
    float32 (transformers' own, `floor`): the bound is twice that, or LOGITS_REL_TOL if larger."""
    from app.worker.loader.weights import load_tensors

    model_dir, hf, floor = llama_8b
    runner = ModelRunner(
        settings(model_dir, load_format="dummy", attention_backend=backend, max_model_len=2048,
                 gpu_memory_utilization=0.5, max_num_seqs=4, chunked_prefill_size=2048),
        CUDA,
    )  # fmt: skip
    load_tensors(runner.model, iter(hf.state_dict().items()))
    errors = logits_errors(runner, hf, prompts_for(runner.vocab_size, PROMPTS_8B, seed=8), 6)
    print(f"8B bf16 {backend}: logits relative L2 error, worst position per prompt: {errors}; transformers' "
          f"own bf16 error against float32: {floor:.4f}")
    assert max(errors) < max(LOGITS_REL_TOL, 2 * floor)
