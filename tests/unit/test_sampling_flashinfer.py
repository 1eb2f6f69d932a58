"""`--sampling-backend flashinfer` without a GPU: which rows reach which kernel, how the plan lays them
out, start-up errors, validation, and the sampled distribution with TorchKernels standing in for
flashinfer.sampling (its 0.6.1 kernels' semantics in torch: top-k keeps logits >= the k-th largest,
top-p keeps a token when the mass of the strictly more likely ones is below top_p, min-p keeps
p >= min_p * p_max). tests/gpu/test_flashinfer_sampling.py runs the same statistics on the real
kernels.

Statistics: SAMPLES draws of one distribution (one row per slot, one step) are compared with the
exact distribution the portable sampler defines (its own truncation code, in float64) by a
chi-square goodness-of-fit test at alpha = 0.001 (categories with fewer than 5 expected draws are
pooled); tokens outside the support must never appear. With fixed seeds the draws are deterministic.
"""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch

from app.protocol import SamplingParams
from app.sampling_checks import check_for_backend
from app.worker.sampling import FlashInferSampler, Sampler, make_sampler
from app.worker.sampling.batch import plan_batch
from app.worker.sampling.flashinfer_sampler import FLASHINFER_ROUTE, MIN_P, PLAIN, TOP_P, kernel_group
from app.worker.sampling.truncation import apply_min_p, apply_top_k_top_p

CPU = torch.device("cpu")
VOCAB = 10
SAMPLES = 4000
CHI2_Z = 3.0902  # standard normal quantile at 1 - 0.001

# Ten tokens with known probabilities, shuffled so that vocabulary order is not probability order
# (as in test_sampling.py); token 9 is EOS here.
PROBS = [0.3, 0.2, 0.15, 0.1, 0.08, 0.07, 0.05, 0.03, 0.015, 0.005]
ORDER = [7, 2, 9, 0, 5, 3, 8, 1, 6, 4]

# (params, prompt ids): each exercises one route, with the processing stages in front of it.
CASES = [
    (SamplingParams(temperature=0.7), []),
    (SamplingParams(top_k=3), []),
    (SamplingParams(top_p=0.55), []),
    (SamplingParams(top_k=5, top_p=0.8, temperature=1.5), []),
    (SamplingParams(min_p=0.2, temperature=2.0), []),
    (SamplingParams(top_k=8, min_p=0.3), []),  # the portable draw: min-p after top-k
    (
        SamplingParams(
            top_p=0.9, logit_bias={4: 3.0, 7: -1.0}, repetition_penalty=1.8, min_new_tokens=2, temperature=0.8
        ),
        [2, 5],
    ),  # fmt: skip
]


def known_logits(vocab: int = VOCAB) -> torch.Tensor:
    logits = torch.full((vocab,), -20.0, dtype=torch.float64)  # any extra tokens: a negligible tail
    for rank, token in enumerate(ORDER):
        logits[token] = math.log(PROBS[rank])
    return logits.float()


class TorchKernels:
    """flashinfer.sampling's kernels used by FlashInferSampler, in torch, recording each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def top_k_mask_logits(self, logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
        assert top_k.dtype == torch.int32
        self.calls.append(("top_k_mask_logits", logits.shape[0]))
        k = top_k.long().clamp(max=logits.shape[1]).unsqueeze(1)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, k - 1)
        return logits.masked_fill(logits < kth, -math.inf)

    def top_p_sampling_from_probs(
        self, probs: torch.Tensor, top_p: torch.Tensor, generator: Any
    ) -> torch.Tensor:
        self.calls.append(("top_p_sampling_from_probs", probs.shape[0]))
        above = (probs.unsqueeze(1) * (probs.unsqueeze(1) > probs.unsqueeze(2))).sum(-1)  # mass above each
        return self._draw(probs * (above < top_p.unsqueeze(1)), generator)

    def min_p_sampling_from_probs(
        self, probs: torch.Tensor, min_p: torch.Tensor, generator: Any
    ) -> torch.Tensor:
        self.calls.append(("min_p_sampling_from_probs", probs.shape[0]))
        keep = probs >= min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        return self._draw(probs * keep, generator)

    def sampling_from_probs(self, probs: torch.Tensor, generator: Any) -> torch.Tensor:
        self.calls.append(("sampling_from_probs", probs.shape[0]))
        return self._draw(probs, generator)

    @staticmethod
    def _draw(weights: torch.Tensor, generator: Any) -> torch.Tensor:
        return torch.multinomial(weights, 1, generator=generator).squeeze(1).int()


def fake_flashinfer(vocab: int = VOCAB, slots: int = 16, seed: int = 0) -> FlashInferSampler:
    return FlashInferSampler(vocab, [9], CPU, slots, TorchKernels(), seed=seed)


# ---------------------------------------------------------------- statistics, shared with the GPU tests


def expected_distribution(processed: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The portable sampler's distribution for one row of processed logits, in float64."""
    x = processed.double().unsqueeze(0) / p.temperature
    vocab = x.shape[1]
    top_k = torch.tensor([vocab if p.top_k == -1 else min(p.top_k, vocab)], device=x.device)
    x = apply_top_k_top_p(x, top_k, torch.tensor([p.top_p], dtype=torch.float64, device=x.device))
    if p.min_p > 0:
        x = apply_min_p(x, torch.tensor([p.min_p], dtype=torch.float64, device=x.device))
    return torch.softmax(x[0], dim=0).cpu()


def chi2_critical(df: int) -> float:
    """The chi-square quantile at 1 - 0.001 (Wilson-Hilferty; within 3% for df >= 1, on the safe side)."""
    c = 2 / (9 * df)
    return df * (1 - c + CHI2_Z * math.sqrt(c)) ** 3


def pooled(counts: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Categories with fewer than 5 expected draws pooled into one, itself pooled into the smallest
    other category while below 5."""
    order = np.argsort(-expected)
    big = [i for i in order if expected[i] >= 5]
    small = [i for i in order if expected[i] < 5]
    obs = [counts[i] for i in big] + ([counts[small].sum()] if small else [])
    exp = [expected[i] for i in big] + ([expected[small].sum()] if small else [])
    if len(exp) > 1 and exp[-1] < 5:
        obs[-2] += obs.pop()
        exp[-2] += exp.pop()
    return np.asarray(obs, dtype=np.float64), np.asarray(exp, dtype=np.float64)


def goodness_of_fit(counts: np.ndarray, probs: torch.Tensor) -> tuple[float, float]:
    """(chi-square statistic, critical value); counts outside the support are a failure by themselves."""
    probs_np = probs.numpy()
    assert counts[probs_np == 0].sum() == 0, "a token outside the distribution's support was drawn"
    obs, exp = pooled(counts, probs_np * counts.sum())
    if len(exp) < 2:
        return 0.0, math.inf
    return float(((obs - exp) ** 2 / exp).sum()), chi2_critical(len(exp) - 1)


def homogeneity(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Two-sample chi-square test (2 x K table) that a and b come from one distribution."""
    keep = (a + b) > 0
    table = np.stack([a[keep], b[keep]]).astype(np.float64)
    exp = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    mask = exp.min(0) >= 5  # columns too thin for the test are pooled into one
    thin = table[:, ~mask].sum(1, keepdims=True)
    table = np.concatenate([table[:, mask], thin], 1) if (~mask).any() else table[:, mask]
    exp = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    if table.shape[1] < 2:
        return 0.0, math.inf
    return float(((table - exp) ** 2 / exp).sum()), chi2_critical(table.shape[1] - 1)


def draw_counts(
    sampler: Sampler, params: SamplingParams, prompt: list[int], logits: torch.Tensor
) -> tuple[np.ndarray, torch.Tensor]:
    """One step over SAMPLES slots holding identical requests: (token counts, the processed logits)."""
    slots = list(range(SAMPLES))
    for slot in slots:
        sampler.add_seq(slot, f"r{slot}", params, prompt, [])
    batch = logits.expand(SAMPLES, -1).to(sampler.device)
    processed = sampler.process_logits(batch[:1], [0])[0]
    tokens = sampler.sample(batch, slots).token_ids.cpu().numpy()
    for slot in slots:
        sampler.remove_seq(slot)
    return np.bincount(tokens, minlength=logits.shape[0]), processed


# ---------------------------------------------------------------- routing


def test_kernel_groups() -> None:
    sampler = fake_flashinfer()
    params = [
        SamplingParams(top_p=0.9),  # top-p
        SamplingParams(top_k=5, top_p=0.5),  # top-k then top-p
        SamplingParams(min_p=0.1),  # min-p
        SamplingParams(),  # plain
        SamplingParams(top_k=3),  # top-k alone: masked, then plain
        SamplingParams(top_k=3, min_p=0.1),  # min-p after top-k: portable
        SamplingParams(top_p=0.5, min_p=0.1),  # min-p after top-p: portable
        SamplingParams(top_k=VOCAB + 5),  # clipped to the vocabulary: no top-k
    ]
    for slot, p in enumerate(params):
        sampler.add_seq(slot, f"r{slot}", p, [], [])
    groups = kernel_group(sampler._table, np.arange(len(params)))
    assert groups.tolist() == [TOP_P, TOP_P, MIN_P, PLAIN, PLAIN, -1, -1, PLAIN]


def test_plan_puts_kernel_rows_first_group_by_group() -> None:
    sampler = fake_flashinfer(slots=10)
    params = {
        0: SamplingParams(temperature=0.0),  # greedy
        1: SamplingParams(top_k=3, min_p=0.2),  # portable (truncates)
        2: SamplingParams(),  # plain
        3: SamplingParams(top_p=0.5, temperature=0.5),  # top-p
        4: SamplingParams(seed=3, top_p=0.7),  # seeded: portable
        5: SamplingParams(min_p=0.3),  # min-p
        6: SamplingParams(top_p=0.8, temperature=1.5),  # top-p
    }
    for slot, p in params.items():
        sampler.add_seq(slot, f"r{slot}", p, [], [])
    slots = [6, 0, 5, 1, 4, 2, 3]
    plan = plan_batch(sampler._table, slots, FLASHINFER_ROUTE)
    assert plan.kernel_groups == (2, 1, 1) and plan.num_kernel_rows == 4
    # Rows (positions in the batch): top-p rows 0 (slot 6) and 6 (slot 3), min-p row 2, plain row 5;
    # then the portable unseeded row 3 (slot 1), then the seeded row 4.
    assert plan.sample_rows.tolist() == [0, 6, 2, 5, 3, 4] and plan.num_unseeded == 5
    assert plan.dev["temperature"].tolist() == [1.5, 0.5, 1.0, 1.0, 1.0, 1.0]
    assert plan.dev["top_p"][:2].tolist() == pytest.approx([0.8, 0.5])
    # The portable flags describe the portable rows only (slots 1 and 4).
    assert plan.truncates and plan.need_min_p and plan.verify_nucleus
    only_kernel_rows = plan_batch(sampler._table, [6, 5, 2, 0], FLASHINFER_ROUTE)
    assert only_kernel_rows.kernel_groups == (1, 1, 1)
    assert not only_kernel_rows.truncates and not only_kernel_rows.need_min_p
    portable = plan_batch(sampler._table, slots)  # the portable sampler's plan: no kernel rows
    assert portable.kernel_groups == () and portable.sample_rows.tolist() == [0, 2, 3, 5, 6, 4]


def test_each_row_gets_its_own_token() -> None:
    """Every route at once, rows shuffled: a row whose logits single out one token must get it."""
    sampler = fake_flashinfer(vocab=32, slots=16, seed=1)
    params = [SamplingParams(top_p=0.9), SamplingParams(min_p=0.5), SamplingParams(), SamplingParams(top_k=2),
              SamplingParams(top_k=4, min_p=0.5), SamplingParams(seed=11), SamplingParams(temperature=0.0),
              SamplingParams(top_p=0.5, top_k=7, temperature=0.3)]  # fmt: skip
    for slot, p in enumerate(params):
        sampler.add_seq(slot, f"r{slot}", p, [], [])
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        order = torch.randperm(len(params), generator=gen).tolist()
        targets = torch.randint(0, 32, (len(order),), generator=gen)
        logits = torch.randn(len(order), 32, generator=gen)
        logits[torch.arange(len(order)), targets] = 60.0  # all other tokens: below 1e-20 of it
        out = sampler.sample(logits, order)
        assert out.token_ids.tolist() == targets.tolist()
    names = [name for name, _ in sampler.kernels.calls]
    assert set(names) == {"top_k_mask_logits", "top_p_sampling_from_probs", "min_p_sampling_from_probs",
                          "sampling_from_probs"}  # fmt: skip


def test_seeded_and_greedy_rows_match_the_portable_sampler() -> None:
    """Seeded rows take the portable draw: the same tokens as the portable sampler, whatever the batch."""
    fast, portable = fake_flashinfer(vocab=64, slots=8, seed=5), Sampler(64, [9], CPU, 8, seed=6)
    for sampler in (fast, portable):
        sampler.add_seq(
            0, "seeded", SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234), [1], []
        )
        sampler.add_seq(1, "greedy", SamplingParams(temperature=0.0, presence_penalty=0.5), [2], [])
    fast.add_seq(2, "other", SamplingParams(temperature=1.0, top_p=0.7), [3], [])  # a kernel row beside them
    gen = torch.Generator().manual_seed(2)
    for _ in range(12):
        logits = torch.randn(3, 64, generator=gen) * 2
        ours = fast.sample(logits, [2, 1, 0]).token_ids.tolist()
        theirs = portable.sample(logits[1:], [1, 0]).token_ids.tolist()
        assert ours[1:] == theirs
    assert ("top_p_sampling_from_probs", 1) in fast.kernels.calls


def test_bad_rows_and_logprobs_as_the_portable_sampler() -> None:
    sampler = fake_flashinfer(vocab=10, slots=4)
    for slot in range(3):
        sampler.add_seq(slot, f"r{slot}", SamplingParams(temperature=1.0, top_p=0.9, logprobs=True), [], [])
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    logits[1, 2] = float("nan")
    out = sampler.sample(logits, [0, 1, 2])
    assert out.bad_rows == [1] and out.logprobs[1] is None
    expected = torch.log_softmax(logits[0].double(), dim=0)[out.token_ids[0]].item()
    assert out.logprobs[0].logprob == pytest.approx(expected, abs=1e-5)


# ---------------------------------------------------------------- distribution (stand-in kernels)


@pytest.mark.parametrize(("params", "prompt"), CASES)
def test_distribution_matches_the_portable_semantics(params: SamplingParams, prompt: list[int]) -> None:
    sampler = fake_flashinfer(slots=SAMPLES, seed=2024)
    counts, processed = draw_counts(sampler, params, prompt, known_logits())
    stat, critical = goodness_of_fit(counts, expected_distribution(processed, params))
    assert stat < critical, (stat, critical, counts.tolist())
    # The test has power: the distribution before temperature and truncation is rejected.
    wrong_stat, wrong_critical = goodness_of_fit(counts, torch.softmax(processed.double(), dim=0))
    assert wrong_stat > wrong_critical


# ---------------------------------------------------------------- start-up and validation


def test_flashinfer_backend_needs_cuda_and_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="--sampling-backend flashinfer needs a CUDA device, not cpu"):
        make_sampler("flashinfer", 16, [15], CPU, 4)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # as if not installed
    with pytest.raises(ValueError, match="--sampling-backend flashinfer needs the flashinfer-python"):
        make_sampler("flashinfer", 16, [15], torch.device("cuda"), 4)

    def no_compiler() -> None:
        raise RuntimeError("nvcc not found")

    installed = types.ModuleType("flashinfer")
    installed.sampling = types.SimpleNamespace(get_sampling_module=no_compiler)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", installed)
    with pytest.raises(ValueError, match="--sampling-backend flashinfer could not build .*nvcc not found"):
        make_sampler("flashinfer", 16, [15], torch.device("cuda"), 4)


def test_flashinfer_validates_like_the_portable_sampler() -> None:
    requests = [
        SamplingParams(temperature=0.7, top_k=4, min_p=0.1, seed=3, logit_bias={1: 2.0}, min_new_tokens=2),
        SamplingParams(top_p=2.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=True, top_logprobs=3),
    ]
    sampler = fake_flashinfer(vocab=16)
    answers = [sampler.validate(p) for p in requests]
    assert answers == [check_for_backend(None, p, 16) for p in requests]
    assert answers == [check_for_backend("flashinfer", p, 16) for p in requests]
    assert [a is None for a in answers] == [True, False, True]


def test_config_accepts_the_flashinfer_sampler() -> None:
    pytest.importorskip("pydantic")  # the GPU machine runs this module's statistics without it
    from app.config.support import BY_FIELD

    rule = BY_FIELD["sampling_backend"]
    assert all(rule.supported(v) for v in (None, "greedy", "flashinfer"))
    assert not any(rule.supported(v) for v in ("flashinfer_full", "triton", "triton_full"))
