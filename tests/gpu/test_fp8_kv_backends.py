"""The FP8 KV cache on the triton and flashinfer backends, on CUDA (skipped without it).

- kernels: the fused write stores the codes torch's cast gives (the hardware conversion), and decode /
  prefill over an FP8 cache with bfloat16 and float16 queries stay within REL_TOL of a float64
  reference over the dequantized cache (the interpreter tests cannot run bfloat16);
- the model runner, tiny bfloat16 Llama (head_dim 128, so flashinfer serves it) with calibrated KV
  scales: each backend's free-running greedy run (decodes replayed from CUDA graphs) is fed to the
  torch backend's FP8 run token by token; per position the logits are within LOGITS_REL_TOL
  (relative L2) and the torch run picks the same token at a rate >= GREEDY_AGREEMENT (both read the
  same FP8 codes; what differs is bfloat16 summation order, which can flip a near-tie);
- graphs vs eager on an FP8 cache: identical tokens, every batch size a captured size.
"""

from __future__ import annotations

import gc
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from app.protocol import NewSeq, SamplingParams, SeqChunk, StepPlan
from app.worker.model_runner import ModelRunner
from app.worker.quantization.calibrate import calibrate_kv_scales
from tests.gpu.test_backends_gpu import BACKENDS, run_requests, settings
from tests.support.model_factory import build_tiny_model
from tests.support.numerics import relative_error as rel_err
from tests.unit.test_model_runner import Request, ScriptedScheduler, prompts_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda", 0)
FP8 = torch.float8_e4m3fn
REL_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}  # as in tests/kernels/test_fp8_kv_kernels.py
LOGITS_REL_TOL = 0.05
GREEDY_AGREEMENT = 0.9
FP8_BACKENDS = BACKENDS[1:]  # triton, flashinfer (skipped when not installed)


@pytest.fixture(autouse=True)
def free_gpu_memory() -> Iterator[None]:
    yield
    gc.collect()
    torch.cuda.empty_cache()



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_kernels_on_cuda(dtype: torch.dtype) -> None:
    from tokenspeed_kernels import decode_attention, kv_write, prefill_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    k_scale, v_scale = 0.05, 0.02
    values = torch.randn(600, 8, 128, device="cuda", generator=gen) * 10
    values[0, 0, :3] = torch.tensor([1e4, -1e4, -0.0])  # saturation, negative zero
    caches = [torch.zeros(40 * 16, 8, 128, dtype=FP8, device="cuda") for _ in range(4)]
    slots = torch.randperm(40 * 16, device="cuda", generator=gen)[:600]
    kv_write.write_kv(values.to(dtype), values.to(dtype), caches[0], caches[1], slots, k_scale, v_scale)
    kv_write.write_kv_reference(
        values.to(dtype), values.to(dtype), caches[2], caches[3], slots, k_scale, v_scale
    )
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    k, v = caches[0].view(40, 16, 8, 128), caches[1].view(40, 16, 8, 128)
    table = torch.randperm(40, device="cuda", generator=gen).int().view(2, 20)
    seq_lens = torch.tensor([300, 17], dtype=torch.int32, device="cuda")
    q = (torch.randn(2, 32, 128, device="cuda", generator=gen) * 0.1).to(dtype)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    out = decode_attention.paged_decode_attention(q, k, v, table, seq_lens, 128**-0.5, 7, **scales)
    ref = decode_attention.paged_decode_attention_reference(q, k, v, table, seq_lens, 128**-0.5, **scales)
    assert rel_err(out, ref) < REL_TOL[dtype]
    cu = torch.tensor([0, 100, 117], dtype=torch.int32, device="cuda")
    qp = (torch.randn(117, 32, 128, device="cuda", generator=gen) * 0.1).to(dtype)
    out = prefill_attention.paged_prefill_attention(qp, k, v, table, cu, seq_lens, 100, 128**-0.5, **scales)
    ref = prefill_attention.paged_prefill_attention_reference(
        qp, k, v, table, cu, seq_lens, 128**-0.5, **scales
    )
    assert rel_err(out, ref) < REL_TOL[dtype]


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8kv")
    model_dir = build_tiny_model("llama", root / "m", seed=4, head_dim=128, initializer_range=0.1)
    calibration = prompts_for(int(json.loads((model_dir / "config.json").read_text())["vocab_size"]),
                              [40, 40], seed=9)  # fmt: skip
    scales = root / "kv.json"
    scales.write_text(json.dumps(calibrate_kv_scales(model_dir, calibration, torch.device("cpu"), "float32")))
    return model_dir, scales


def fp8_runner(model_dir: Path, scales: Path, backend: str, **overrides: Any) -> ModelRunner:
    runner = ModelRunner(
        settings(model_dir, dtype="bfloat16", attention_backend=backend, kv_cache_dtype="fp8_e4m3",
                 quantization_param_path=str(scales), **overrides),
        CUDA,
    )  # fmt: skip
    assert runner.kv_cache.k[0].dtype == FP8 and runner.kv_cache.k_scales != (1.0,) * len(runner.kv_cache.k)
    assert runner.ready_message().info["attention_backend"] == backend
    return runner


@contextmanager
def recorded_logits(runner: ModelRunner) -> Iterator[list[torch.Tensor]]:
    """Record the logits row of every position the runner samples (one request at a time)."""
    seen: list[torch.Tensor] = []
    sample = runner.sampler.sample

    def spy(logits: torch.Tensor, slots: list[int]) -> Any:
        seen.extend(row.float().clone() for row in logits)
        return sample(logits, slots)

    runner.sampler.sample = spy
    try:
        yield seen
    finally:
        runner.sampler.sample = sample


def teacher_forced_logits(runner: ModelRunner, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits after the prompt and after each of tokens[:-1], fed one step at a time."""
    blocks = list(range(math.ceil((len(prompt) + len(tokens)) / runner.block_size)))
    seq = NewSeq(slot=0, rid="tf", sampling=SamplingParams(temperature=0.0), num_prompt_tokens=len(prompt),
                 block_ids=blocks, prompt_ids=prompt)  # fmt: skip
    with recorded_logits(runner) as seen:
        runner.execute(StepPlan(0, new_seqs=[seq], chunks=[SeqChunk(0, list(prompt))]))
        for step, token in enumerate(tokens[:-1], start=1):
            runner.execute(StepPlan(step, chunks=[SeqChunk(0, [token])]))
        runner.execute(StepPlan(len(tokens), free_slots=[0]))
    return torch.stack(seen)


@pytest.mark.parametrize("backend", FP8_BACKENDS)
def test_greedy_run_agrees_with_the_torch_backend(backend: str, tiny_fp8: tuple[Path, Path]) -> None:
    model_dir, scales = tiny_fp8
    runner = fp8_runner(model_dir, scales, backend)
    assert runner.graphs is not None  # the decodes below replay CUDA graphs
    reference = fp8_runner(model_dir, scales, "torch")
    matches = total = 0
    worst = 0.0
    for prompt in prompts_for(runner.vocab_size, [7, 70, 19], seed=2):
        sched = ScriptedScheduler(runner)
        sched.add(Request("r", prompt, max_new=24))
        with recorded_logits(runner) as seen:
            tokens = sched.run()["r"]
        ours = torch.stack(seen)
        ref = teacher_forced_logits(reference, prompt, tokens)
        worst = max(worst, ((ours - ref).norm(dim=1) / ref.norm(dim=1)).max().item())
        matches += int((ref.argmax(dim=1).cpu() == torch.tensor(tokens)).sum())
        total += len(tokens)
    print(f"{backend} FP8 KV vs torch FP8 KV: worst logits relative L2 {worst:.4f}, "
          f"greedy agreement {matches}/{total}")  # fmt: skip
    assert worst < LOGITS_REL_TOL
    assert matches / total >= GREEDY_AGREEMENT


@pytest.mark.parametrize("backend", FP8_BACKENDS)
def test_graph_and_eager_give_identical_tokens_on_fp8(backend: str, tiny_fp8: tuple[Path, Path]) -> None:
    model_dir, scales = tiny_fp8
    graphed = fp8_runner(model_dir, scales, backend, cudagraph_capture_sizes=[1, 2, 3, 4], max_num_seqs=4)
    eager = fp8_runner(model_dir, scales, backend, enforce_eager=True, max_num_seqs=4)
    assert graphed.graphs is not None and eager.graphs is None
    prompts = prompts_for(graphed.vocab_size, [9, 33, 4, 17], seed=3)
    assert run_requests(graphed, prompts, 40) == run_requests(eager, prompts, 40)
