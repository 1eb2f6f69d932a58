"""`--sampling-backend flashinfer` on its real kernels (skipped without CUDA or flashinfer-python).

- the token distribution of each route (top-p, top-k + top-p, min-p, plain, top-k alone, and the
  portable min-p-after-top-k one, with bias / penalties / min_new_tokens in front) matches the exact
  distribution the portable sampler defines (chi-square goodness of fit, alpha = 0.001, fixed seeds;
  tests/unit/test_sampling_flashinfer.py has the statistics), and the portable sampler's own draws
  (two-sample chi-square); also over a 151,936-token vocabulary (flashinfer's multi-CTA top-k);
- greedy rows are the argmax and seeded rows give the portable sampler's tokens, in mixed batches;
- the model runner with --sampling-backend flashinfer: greedy and seeded requests give the tokens of
  the portable sampler's run.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from app.protocol import SamplingParams, StepPlan
from app.worker.model_runner import ModelRunner
from app.worker.sampling import FlashInferSampler, Sampler, make_sampler
from tests.gpu.test_model_runner_gpu import settings
from tests.support.model_factory import build_tiny_model
from tests.unit.test_model_runner import Request, ScriptedScheduler, prompts_for
from tests.unit.test_sampling_flashinfer import (
    CASES,
    VOCAB,
    draw_counts,
    expected_distribution,
    goodness_of_fit,
    homogeneity,
    known_logits,
)


def _has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not _has_flashinfer(), reason="needs flashinfer-python"),
]
CUDA = torch.device("cuda", 0)
LARGE_VOCAB = 151_936


@pytest.fixture(autouse=True)
def free_gpu_memory() -> Iterator[None]:
    yield
    gc.collect()
    torch.cuda.empty_cache()


class RecordingKernels:
    """flashinfer.sampling, recording the name of every kernel FlashInferSampler calls."""

    def __init__(self, kernels: Any) -> None:
        self._kernels = kernels
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Callable[..., Any]:
        kernel = getattr(self._kernels, name)

        @functools.wraps(kernel)
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return kernel(*args, **kwargs)

        return call


def flashinfer_sampler(vocab: int, slots: int, seed: int) -> FlashInferSampler:
    sampler = make_sampler("flashinfer", vocab, [9], CUDA, slots, seed=seed)
    assert isinstance(sampler, FlashInferSampler)
    sampler.kernels = RecordingKernels(sampler.kernels)
    return sampler


def spread_logits(vocab: int) -> torch.Tensor:
    """The ten known tokens spread across a large vocabulary (EOS, 9, stays), the rest a -20 tail."""
    ids = torch.arange(VOCAB) * (vocab // VOCAB) + 7
    ids[9] = 9
    logits = torch.full((vocab,), -20.0)
    logits[ids] = known_logits()
    return logits


def check_case(params: SamplingParams, prompt: list[int], logits: torch.Tensor, seed: int) -> None:
    vocab = logits.shape[0]
    fast = flashinfer_sampler(vocab, 4000, seed)
    counts, processed = draw_counts(fast, params, prompt, logits)
    expected = expected_distribution(processed, params)
    stat, critical = goodness_of_fit(counts, expected)
    assert stat < critical, ("flashinfer", params, stat, critical)
    portable = Sampler(vocab, [9], CUDA, 4000, seed=seed + 1)
    portable_counts, _ = draw_counts(portable, params, prompt, logits)
    assert goodness_of_fit(portable_counts, expected)[0] < critical
    two_stat, two_critical = homogeneity(counts, portable_counts)
    assert two_stat < two_critical, ("flashinfer vs portable", params, two_stat, two_critical)
    routed_to_kernels = not (params.min_p > 0 and (params.top_k != -1 or params.top_p < 1))
    assert bool(fast.kernels.calls) == routed_to_kernels, fast.kernels.calls


@pytest.mark.parametrize(("params", "prompt"), CASES)
def test_distribution_matches_the_portable_sampler(params: SamplingParams, prompt: list[int]) -> None:
    check_case(params, prompt, known_logits(), seed=2024)


@pytest.mark.parametrize(("params", "prompt"), [CASES[0], CASES[1], CASES[3], CASES[4]])  # no token ids
def test_distribution_over_a_large_vocabulary(params: SamplingParams, prompt: list[int]) -> None:
    check_case(params, prompt, spread_logits(LARGE_VOCAB), seed=7)


def test_greedy_and_seeded_rows_in_mixed_batches() -> None:
    vocab, rows = LARGE_VOCAB, 48
    fast, portable = flashinfer_sampler(vocab, rows, 1), Sampler(vocab, [9], CUDA, rows, seed=2)
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=77),
             SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=0.7, min_p=0.05, seed=5),
             SamplingParams(temperature=0.0, repetition_penalty=1.3)]  # fmt: skip
    for slot in range(rows):
        p = kinds[slot % len(kinds)]
        fast.add_seq(slot, f"r{slot}", p, [1, 2, 3], [])
        portable.add_seq(slot, f"r{slot}", p, [1, 2, 3], [])
    gen = torch.Generator(device="cuda").manual_seed(0)
    exact = [
        slot
        for slot in range(rows)
        if kinds[slot % len(kinds)].greedy or kinds[slot % len(kinds)].seed is not None
    ]
    for _ in range(6):
        order = torch.randperm(rows, device="cuda", generator=gen).tolist()
        logits = torch.randn(rows, vocab, device="cuda", generator=gen) * 3
        ours, theirs = fast.sample(logits, order).token_ids, portable.sample(logits, order).token_ids
        rows_exact = [order.index(slot) for slot in exact]
        assert ours[rows_exact].tolist() == theirs[rows_exact].tolist()
    assert "top_k_mask_logits" in fast.kernels.calls and "sampling_from_probs" in fast.kernels.calls


class SamplingScheduler(ScriptedScheduler):
    """ScriptedScheduler whose requests sample with their own parameters (it admits them greedy)."""

    def __init__(self, runner: ModelRunner, sampling: dict[str, SamplingParams]) -> None:
        super().__init__(runner)
        self.sampling = sampling

    def _admit(self, req: Request, plan: StepPlan) -> None:
        super()._admit(req, plan)
        plan.new_seqs[-1].sampling = self.sampling[req.rid]


def test_runner_with_the_flashinfer_sampler(tmp_path: Path) -> None:
    """Greedy and seeded requests never reach flashinfer's kernels: the same tokens as the portable run."""
    model_dir = build_tiny_model("llama", tmp_path, seed=3, head_dim=128)
    kinds = {
        "greedy": SamplingParams(temperature=0.0),
        "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=42),
    }
    outputs = {}
    for backend in (None, "flashinfer"):
        runner = ModelRunner(settings(model_dir, dtype="bfloat16", sampling_backend=backend), CUDA)
        assert isinstance(runner.sampler, FlashInferSampler) == (backend == "flashinfer")
        sampling = {}
        sched = SamplingScheduler(runner, sampling)
        for i, prompt in enumerate(prompts_for(runner.vocab_size, [6, 30], seed=4)):
            for name, params in kinds.items():
                sampling[f"{name}{i}"] = params
                sched.add(Request(f"{name}{i}", prompt, max_new=16, join_step=i))
        outputs[backend] = sched.run()
        del runner, sched
    assert outputs["flashinfer"] == outputs[None]
