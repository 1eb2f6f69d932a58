"""Pipelined worker steps on CUDA with graphs (skipped without CUDA): the same results as plain execute,
no host sync when a decode step is launched on the common sampling paths (min_tokens, logit bias and
penalties included) nor when a prefill or mixed step is, and the idle gap between
decode steps reported (scripts/gpu/gpu_idle.py measures it at Llama-3.1-8B scale)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from app.protocol import NewSeq, SamplingParams, SeqChunk, StepPlan
from app.worker.model_runner import ModelRunner
from tests.gpu.test_model_runner_gpu import settings
from tests.support.model_factory import build_tiny_model
from tests.unit.test_worker_pipeline import plans_for, run_pipelined, run_plain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda", 0)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), seed=5)


def cuda_runner(model_dir: Path, **overrides: Any) -> ModelRunner:
    """The unit tests' runner shape (4 slots, blocks of 4), on CUDA with the triton backend and graphs."""
    fields = {"dtype": "float32", "block_size": 4, "max_num_seqs": 4, "chunked_prefill_size": 16,
              "max_total_tokens": 4096, "attention_backend": "triton", **overrides}  # fmt: skip
    runner = ModelRunner(settings(model_dir, **fields), CUDA)
    assert runner.graphs is not None
    return runner


def count_replays(runner: ModelRunner) -> list[int]:
    count = [0]
    run = runner.graphs.run

    def counted(*args: Any) -> torch.Tensor:
        count[0] += 1
        return run(*args)

    runner.graphs.run = counted
    return count


def test_pipelined_steps_match_plain_execute_with_cuda_graphs(model_dir: Path) -> None:
    runner = cuda_runner(model_dir)
    reference = run_plain(runner, plans_for(runner))
    assert all(r.error is None and not r.bad_slots for r in reference)
    for depth in (1, 2):
        runner = cuda_runner(model_dir)  # fresh sampler generators, as the reference had
        replays = count_replays(runner)
        plans = plans_for(runner)
        decode_only = sum(1 for plan in plans if plan.chunks and all(not c.token_ids for c in plan.chunks))
        assert run_pipelined(runner, plans, depth) == reference, f"depth {depth}"
        assert replays[0] == decode_only > 0  # every decode-only step ran as a graph replay
        assert not any(runner.slots.active)


@pytest.mark.parametrize("precision", [{"dtype": "float32"}, {"dtype": "bfloat16", "quantization": "fp8"}])
def test_programmatic_dependent_launch_gives_the_same_tokens(model_dir: Path, precision: dict[str, str]) -> None:
    """Kernels launched with PDL (--enable-pdl, the default on Hopper), graphs captured with it, pipelined:
    the tokens of the plain launches. Each kernel waits for its predecessor before touching what that one
    writes, so a wrong placement shows as a race here. FP8 weights run every decode linear through the
    GEMV, whose weight scales load before the wait (as the norm's weight does)."""
    runner = cuda_runner(model_dir, enable_pdl=False, **precision)
    assert not runner.pdl
    reference = run_plain(runner, plans_for(runner))
    for _ in range(2):
        runner = cuda_runner(model_dir, enable_pdl=True, **precision)  # fresh sampler generators
        assert runner.pdl == (torch.cuda.get_device_capability(CUDA) >= (9, 0))
        assert run_pipelined(runner, plans_for(runner), 2) == reference


COMMON = [
    SamplingParams(temperature=0.0, min_new_tokens=20),  # EOS masked: mask_tokens
    SamplingParams(temperature=0.8, top_k=20, seed=1, logit_bias={3: 2.0}),
    SamplingParams(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.5),
    SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
]


def test_decode_launches_never_wait_for_the_device(model_dir: Path) -> None:
    runner = cuda_runner(model_dir)
    prompts = [[5 + s, 6, 7, 8 + s, 9] for s in range(len(COMMON))]
    new = [NewSeq(s, f"r{s}", p, 5, [2 * s, 2 * s + 1], prompt_ids=prompts[s]) for s, p in enumerate(COMMON)]
    runner.execute(StepPlan(0, new, [SeqChunk(s, prompts[s]) for s in range(len(COMMON))]))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.zeros(1, device=CUDA).item()  # the detector is on
        first = runner.launch(StepPlan(1, chunks=[SeqChunk(s) for s in range(len(COMMON))]))
        second = runner.launch(StepPlan(2, chunks=[SeqChunk(s) for s in range(len(COMMON))]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for step, pending in ((1, first), (2, second)):
        result = runner.finish(pending)
        assert result.step == step and result.slots == [0, 1, 2, 3] and not result.bad_slots
        assert result.logprobs[3].token_id == result.token_ids[3] and len(result.logprobs[3].top_ids) == 3


def test_prefill_and_mixed_launches_never_wait_for_the_device(model_dir: Path) -> None:
    """Steps with prompt chunks (here in graph pieces) are queued without a host sync too: the worker can
    queue a prefill while the step before it runs. Their tokens are those of plain execute."""
    prompts = [[5 + s, 6, 7, 8 + s, 9] for s in range(len(COMMON))]
    new = [NewSeq(s, f"r{s}", p, 5, [2 * s, 2 * s + 1], prompt_ids=prompts[s]) for s, p in enumerate(COMMON)]
    plans = [
        StepPlan(0, new[:2], [SeqChunk(0, prompts[0]), SeqChunk(1, prompts[1])]),
        StepPlan(1, new[2:], [SeqChunk(0), SeqChunk(1), SeqChunk(2, prompts[2]), SeqChunk(3, prompts[3])]),
    ]
    reference = cuda_runner(model_dir)
    expected = [reference.execute(plan).token_ids for plan in plans]
    runner = cuda_runner(model_dir)
    assert runner.pieces is not None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = [runner.launch(plan) for plan in plans]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [runner.finish(p).token_ids for p in pending] == expected


def gpu_idle_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_idle", REPO / "scripts/gpu/gpu_idle.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_idle_gap_between_decode_steps_is_reported(model_dir: Path) -> None:
    script = gpu_idle_script()
    runner = cuda_runner(model_dir)
    args = SimpleNamespace(steps=60, warmup_steps=5, input_len=8, profile=False)
    with torch.inference_mode():
        rows = script.measure(runner, 4, "greedy", args)
    print("\n" + script.table({"results": rows}))
    plain, pipelined = rows
    assert (plain["mode"], pipelined["mode"]) == ("plain", "pipelined") and pipelined["same_tokens_as_plain"]
    for row in rows:
        assert 0.0 <= row["idle_fraction"] < 1.0 and row["gpu_step_ms"] > 0 and row["graph_replay_ms"] > 0


@pytest.mark.parametrize("batch", [1, 4, 64])
def test_two_pass_vocabulary_reductions_match_torch_on_cuda(batch: int) -> None:
    """app.worker.sampling.reduce on CUDA (two passes over 1024-wide pieces of Llama-3's vocabulary):
    torch's argmax and max, ties across and inside pieces included."""
    from app.worker.sampling.reduce import argmax_rows, max_rows

    gen = torch.Generator(device="cuda").manual_seed(batch)
    x = torch.randn(batch, 128256, device="cuda", generator=gen).round(decimals=1)
    x[0, [5000, 5001, 90000]] = 50.0  # tied inside a piece and across pieces
    x[-1, [127000, 2000]] = 60.0  # (the same row at batch 1)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(max_rows(x), x.amax(dim=-1))
    assert argmax_rows(x)[-1].item() == 2000 and (batch == 1 or argmax_rows(x)[0].item() == 5000)
