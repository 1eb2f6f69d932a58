"""The sampler's draws: greedy, seeds, truncation sets, the sampled distribution, bad rows, backends."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.protocol import SamplingParams
from app.sampling_checks import check_for_backend
from app.worker.sampling import GreedySampler, Sampler, make_sampler, truncation
from app.worker.sampling import torch_sampler as torch_sampler_module
from app.worker.sampling.truncation import apply_top_k_top_p

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def make(device: torch.device, vocab: int = 64, slots: int = 16, seed: int = 0) -> Sampler:
    return Sampler(vocab, [vocab - 1], device, slots, seed=seed)


def test_greedy_is_argmax(device: torch.device) -> None:
    sampler = make(device, vocab=50, slots=8)
    for slot, extra in enumerate([{}, {"top_k": 3}, {"top_p": 0.2}, {"min_p": 0.5}, {"seed": 7}]):
        sampler.add_seq(slot, f"r{slot}", SamplingParams(temperature=0.0, **extra), [1, 2], [])
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)).to(device)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = sampler.sample(logits.to(dtype), [4, 2, 0, 1, 3])
        assert out.token_ids.dtype == torch.int64 and out.token_ids.device.type == device.type
        assert out.token_ids.tolist() == logits.to(dtype).float().argmax(dim=-1).tolist()
        assert out.bad_rows == [] and out.logprobs == [None] * 5


def _fixed_logits(steps: int, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(vocab, generator=gen) * 2 for _ in range(steps)]


SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234)


def _run_alone(device: torch.device, steps: list[torch.Tensor]) -> list[int]:
    sampler = make(device, slots=4, seed=99)
    sampler.add_seq(0, "a", SEEDED, [1, 2, 3], [])
    return [sampler.sample(row.unsqueeze(0).to(device), [0]).token_ids.item() for row in steps]


def test_seed_reproducible_whatever_the_batch(device: torch.device) -> None:
    steps = _fixed_logits(12, 64)
    alone = _run_alone(device, steps)
    sampler = make(device, slots=16, seed=5)
    sampler.add_seq(5, "a", SEEDED, [1, 2, 3], [])
    others = {
        0: SamplingParams(temperature=1.0, seed=77),
        3: SamplingParams(temperature=0.7, presence_penalty=0.5, min_p=0.1),
        9: SamplingParams(temperature=0.0),
        12: SamplingParams(temperature=1.3, top_k=2),
    }
    for slot, params in others.items():
        sampler.add_seq(slot, f"o{slot}", params, [4], [])
    gen = torch.Generator().manual_seed(3)
    mixed = []
    for row in steps:
        slots = [5, *others]
        order = [slots[i] for i in torch.randperm(len(slots), generator=gen).tolist()]
        logits = torch.randn(len(order), 64, generator=gen)
        logits[order.index(5)] = row
        out = sampler.sample(logits.to(device), order)
        mixed.append(out.token_ids[order.index(5)].item())
    assert mixed == alone


def test_seed_survives_preemption(device: torch.device) -> None:
    steps = _fixed_logits(10, 64)
    alone = _run_alone(device, steps)
    sampler = make(device, slots=4, seed=1)
    sampler.add_seq(2, "a", SEEDED, [1, 2, 3], [])
    resumed = [sampler.sample(row.unsqueeze(0).to(device), [2]).token_ids.item() for row in steps[:4]]
    sampler.remove_seq(2)
    sampler.add_seq(1, "a", SEEDED, [1, 2, 3], resumed)  # re-enters in another slot
    resumed += [sampler.sample(row.unsqueeze(0).to(device), [1]).token_ids.item() for row in steps[4:]]
    assert resumed == alone


def _draws(sampler: Sampler, slots: list[int], steps: int, vocab: int) -> list[list[int]]:
    logits = torch.zeros(len(slots), vocab, device=sampler.device)
    return [sampler.sample(logits, slots).token_ids.tolist() for _ in range(steps)]


def test_different_seeds_differ(device: torch.device) -> None:
    sampler = make(device, slots=4)
    for slot, seed in enumerate([1, 2, 1]):
        sampler.add_seq(slot, f"r{slot}", SamplingParams(temperature=1.0, seed=seed), [], [])
    draws = _draws(sampler, [0, 1, 2], 20, 64)
    first, second, same_seed = ([step[i] for step in draws] for i in range(3))
    assert first != second
    assert first == same_seed


def test_unseeded_runs_follow_the_process_seed(device: torch.device) -> None:
    runs = []
    for seed in (11, 11, 12):
        sampler = make(device, slots=4, seed=seed)
        for slot in range(3):
            sampler.add_seq(slot, f"r{slot}", SamplingParams(temperature=1.0), [], [])
        runs.append(_draws(sampler, [0, 1, 2], 10, 64))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


# Ten tokens with known probabilities, shuffled so that vocabulary order is not probability order.
PROBS = [0.3, 0.2, 0.15, 0.1, 0.08, 0.07, 0.05, 0.03, 0.015, 0.005]
ORDER = [7, 2, 9, 0, 5, 3, 8, 1, 6, 4]  # ORDER[r] = token id of the r-th most likely token


def _known_logits() -> torch.Tensor:
    logits = torch.empty(10, dtype=torch.float64)
    for rank, token in enumerate(ORDER):
        logits[token] = math.log(PROBS[rank])
    return logits.float()


# (params, the number of top-ranked tokens that may be emitted), worked out by hand from PROBS:
TRUNCATION_CASES = [
    (SamplingParams(top_k=3), 3),
    (SamplingParams(top_p=0.55), 3),  # mass before the 3rd token 0.5 < 0.55, before the 4th 0.65
    (SamplingParams(top_p=0.45), 2),
    (SamplingParams(top_p=1e-9), 1),  # the top token is always kept
    (SamplingParams(top_k=5, top_p=0.8), 4),  # top-p over the top-5 renormalised: 0.783 < 0.8 < 0.904
    (SamplingParams(min_p=0.45), 3),  # prob >= 0.135
    (SamplingParams(min_p=0.45, temperature=2.0), 6),  # sqrt(p_i / p_max) >= 0.45
    (SamplingParams(top_k=5, min_p=0.45, temperature=2.0), 5),
    (SamplingParams(top_k=8, top_p=0.8, temperature=0.5), 3),  # p^2 over the top 8: mass before 0.73, 0.86
]


@pytest.mark.parametrize(("seeded", "candidates"), [(False, 4096), (True, 4096), (False, 8)])
def test_truncation_never_emits_an_excluded_token(
    device: torch.device, seeded: bool, candidates: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(truncation, "CANDIDATES", candidates)  # 8 < V: the partial-sort path
    rows = 600
    sampler = make(device, vocab=10, slots=rows)
    for slot in range(rows):
        params, _ = TRUNCATION_CASES[slot % len(TRUNCATION_CASES)]
        params = SamplingParams(**{f: getattr(params, f) for f in ("temperature", "top_k", "top_p", "min_p")})
        params.seed = slot if seeded else None
        sampler.add_seq(slot, f"r{slot}", params, [], [])
    logits = _known_logits().expand(rows, 10).to(device)
    seen: list[set[int]] = [set() for _ in TRUNCATION_CASES]
    for _ in range(4):
        for slot, token in enumerate(sampler.sample(logits, list(range(rows))).token_ids.tolist()):
            seen[slot % len(TRUNCATION_CASES)].add(token)
    for (params, kept), emitted in zip(TRUNCATION_CASES, seen, strict=True):
        assert emitted == set(ORDER[:kept]), params


def test_top_p_one_keeps_a_negligible_tail(device: torch.device) -> None:
    # Past a dominant token the cumulative mass rounds to 1.0 in float32: top_p=1 must still keep the tail.
    logits = torch.tensor([[40.0, 0.0, 1.0, -3.0], [40.0, 0.0, 1.0, -3.0]], device=device)
    top_k = torch.tensor([3, 4], device=device)
    kept = apply_top_k_top_p(logits, top_k, torch.ones(2, device=device)).isfinite().tolist()
    assert kept == [[True, True, True, False], [True, True, True, True]]
    kept = apply_top_k_top_p(logits, top_k, torch.full((2,), 0.5, device=device)).isfinite().tolist()
    assert kept == [[True, False, False, False]] * 2


def _random_truncation(rows: int, vocab: int, max_k: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    top_k = torch.randint(1, max_k + 1, (rows,), generator=gen)
    top_k[torch.rand(rows, generator=gen) < 0.3] = vocab  # off
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.05
    top_p[torch.rand(rows, generator=gen) < 0.3] = 1.0
    return top_k, top_p


@pytest.mark.parametrize(("scale", "falls_back"), [(6.0, False), (0.1, True)])
def test_partial_sort_equals_full_sort(
    device: torch.device, scale: float, falls_back: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(200, 50, generator=gen) * scale).to(device)
    top_k, top_p = (t.to(device) for t in _random_truncation(200, 50, 8, gen))
    full = apply_top_k_top_p(logits, top_k, top_p)
    sorts = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(
        torch.Tensor, "sort", lambda self, *a, **k: sorts.append(1) or real_sort(self, *a, **k)
    )
    # Every top_k fits in 8 candidates: exact without verification.
    with_k = top_k <= 8
    partial = apply_top_k_top_p(logits[with_k], top_k[with_k], top_p[with_k], width=8)
    assert torch.equal(partial, full[with_k]) and sorts == []
    # Rows with top_p alone: peaked rows (scale 6) fit in 8 candidates, flat ones (0.1) fall back.
    verified = apply_top_k_top_p(logits, top_k, top_p, width=8, verify=True)
    assert torch.equal(verified, full) and sorts == ([1] if falls_back else [])


CHI2_CRITICAL_DF7_P001 = 24.322  # chi-square critical value, 7 degrees of freedom, alpha = 0.001


def _chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_matches_softmax(device: torch.device, seeded: bool) -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    temperature, rows, steps = 0.7, 1000, 4
    sampler = make(device, vocab=8, slots=rows, seed=2024)
    for slot in range(rows):
        params = SamplingParams(temperature=temperature, seed=slot if seeded else None)
        sampler.add_seq(slot, f"r{slot}", params, [], [])
    counts = [0] * 8
    for _ in range(steps):
        for token in sampler.sample(logits.expand(rows, 8).to(device), list(range(rows))).token_ids.tolist():
            counts[token] += 1
    expected = torch.softmax(logits.double() / temperature, dim=0).tolist()
    assert _chi_square(counts, expected) < CHI2_CRITICAL_DF7_P001
    # The test has power: the untempered distribution is rejected.
    assert _chi_square(counts, torch.softmax(logits.double(), dim=0).tolist()) > CHI2_CRITICAL_DF7_P001


def test_bad_rows_are_reported(device: torch.device) -> None:
    sampler = make(device, vocab=8, slots=8)
    for slot in range(6):
        params = SamplingParams(temperature=0.0 if slot % 2 else 1.0, logprobs=True)
        sampler.add_seq(slot, f"r{slot}", params, [], [])
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    logits[0, 3] = float("nan")
    logits[2, 5] = float("inf")
    logits[3, :4] = float("-inf")  # partly masked: fine
    logits[4, :] = float("-inf")  # nothing can be sampled
    out = sampler.sample(logits.to(device), list(range(6)))
    assert out.bad_rows == [0, 2, 4]
    assert [lp is None for lp in out.logprobs] == [True, False, True, False, True, False]
    assert out.token_ids[1].item() == logits[1].argmax().item()
    assert out.token_ids[3].item() == logits[3].argmax().item()
    assert out.token_ids[5].item() == logits[5].argmax().item()


def test_plain_greedy_steps_skip_the_logit_processing(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """All greedy, nothing to process, no logprobs: the argmax of the raw logits, bad rows still reported
    and output counted (min_new_tokens reads the count); one biased row brings the processing back."""
    processed = []
    real = Sampler._process
    monkeypatch.setattr(Sampler, "_process", lambda self, *a: processed.append(1) or real(self, *a))
    sampler = make(device, vocab=8, slots=4)
    for slot in range(3):
        sampler.add_seq(slot, f"r{slot}", SamplingParams(temperature=0.0), [], [])
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    logits[1, 2] = float("nan")
    for _ in range(2):
        out = sampler.sample(logits.to(device, torch.bfloat16), [0, 1, 2])
        assert out.bad_rows == [1]
        assert out.token_ids[[0, 2]].tolist() == logits[[0, 2]].to(torch.bfloat16).float().argmax(-1).tolist()
    assert processed == [] and sampler._table.num_output[:3].tolist() == [2, 2, 2]
    sampler.add_seq(3, "biased", SamplingParams(temperature=0.0, logit_bias={5: 100.0}), [], [])
    out = sampler.sample(torch.zeros(4, 8, device=device), [0, 1, 2, 3])
    assert processed == [1] and out.token_ids[3].item() == 5


def test_sort_only_when_a_row_truncates(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = torch_sampler_module.apply_top_k_top_p
    monkeypatch.setattr(
        torch_sampler_module, "apply_top_k_top_p", lambda *a: calls.append(a[0].shape) or real(*a)
    )
    sampler = make(device, slots=4)
    sampler.add_seq(0, "a", SamplingParams(temperature=0.8, min_p=0.1, presence_penalty=1.0), [], [])
    sampler.add_seq(1, "b", SamplingParams(temperature=0.0, top_k=5), [], [])
    logits = torch.randn(2, 64).to(device)
    sampler.sample(logits, [0, 1])
    assert calls == []  # the greedy row's top_k does not count
    sampler.add_seq(2, "c", SamplingParams(temperature=1.0, top_p=0.9), [], [])
    sampler.sample(torch.randn(3, 64).to(device), [2, 0, 1])
    assert calls == [torch.Size([2, 64])]  # only the two sampled rows were sorted


def test_greedy_backend(device: torch.device) -> None:
    sampler = make_sampler("greedy", 16, [15], device, 4)
    assert isinstance(sampler, GreedySampler)
    assert "temperature" in sampler.validate(SamplingParams(temperature=0.7))
    assert "presence_penalty" in sampler.validate(SamplingParams(temperature=0.0, presence_penalty=0.5))
    assert "logit_bias" in sampler.validate(SamplingParams(temperature=0.0, logit_bias={1: 1.0}))
    assert sampler.validate(SamplingParams(temperature=0.0, top_k=5, seed=3, logprobs=True)) is None
    with pytest.raises(ValueError, match="temperature"):
        sampler.add_seq(0, "hot", SamplingParams(temperature=1.0), [], [])
    sampler.add_seq(0, "a", SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2), [], [])
    sampler.add_seq(1, "b", SamplingParams(temperature=0.0), [], [])
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    logits[1, 0] = float("nan")
    out = sampler.sample(logits.to(device), [0, 1])
    assert out.token_ids[0].item() == logits[0].argmax().item()
    assert out.bad_rows == [1] and out.logprobs[1] is None
    expected = torch.log_softmax(logits[0].double(), dim=0)
    assert out.logprobs[0].logprob == pytest.approx(expected.max().item(), abs=1e-5)
    assert out.logprobs[0].top_ids == expected.topk(2).indices.tolist()


def test_make_sampler_backends(device: torch.device) -> None:
    assert isinstance(make_sampler(None, 16, [15], device, 4), Sampler)
    with pytest.raises(ValueError, match="flashinfer_full"):  # flashinfer: test_sampling_flashinfer.py
        make_sampler("flashinfer_full", 16, [15], device, 4)
    with pytest.raises(ValueError, match="'torch'"):
        make_sampler("torch", 16, [15], device, 4)


def test_check_for_backend_answers_like_the_samplers() -> None:
    requests = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(top_p=2.0),
    ]
    for backend in (None, "greedy"):
        sampler = make_sampler(backend, 16, [15], torch.device("cpu"), 2)
        answers = [sampler.validate(params) for params in requests]
        assert [check_for_backend(backend, params, 16) for params in requests] == answers
    assert [a is None for a in answers] == [True, False, False, False]
    with pytest.raises(ValueError, match="triton"):
        check_for_backend("triton", requests[0], 16)


def test_validation_imports_without_torch() -> None:
    code = "import sys, app.sampling_checks; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=Path(__file__).parents[2])


@pytest.mark.parametrize(
    ("field", "params"),
    [
        ("temperature", SamplingParams(temperature=-0.5)),
        ("temperature", SamplingParams(temperature=float("nan"))),
        ("top_p", SamplingParams(top_p=0.0)),
        ("top_p", SamplingParams(top_p=1.5)),
        ("top_k", SamplingParams(top_k=0)),
        ("min_p", SamplingParams(min_p=1.5)),
        ("presence_penalty", SamplingParams(presence_penalty=float("inf"))),
        ("repetition_penalty", SamplingParams(repetition_penalty=0.0)),
        ("logit_bias", SamplingParams(logit_bias={16: 1.0})),
        ("logit_bias", SamplingParams(logit_bias={"3": 1.0})),
        ("logit_bias", SamplingParams(logit_bias={3: float("nan")})),
        ("stop_token_ids", SamplingParams(stop_token_ids=[-1])),
        ("min_new_tokens", SamplingParams(min_new_tokens=-1)),
        ("seed", SamplingParams(seed=1.5)),
        ("top_logprobs", SamplingParams(logprobs=True, top_logprobs=17)),
        ("top_logprobs", SamplingParams(top_logprobs=2)),
    ],
)
def test_validate_names_the_bad_field(field: str, params: SamplingParams) -> None:
    sampler = Sampler(16, [15], torch.device("cpu"), 2)
    error = sampler.validate(params)
    assert error is not None and field in error
    with pytest.raises(ValueError, match=field):
        sampler.add_seq(0, "r", params, [], [])


def test_validate_accepts_a_full_request() -> None:
    params = SamplingParams(
        temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, presence_penalty=-1.0, frequency_penalty=0.5,
        repetition_penalty=1.2, logit_bias={0: -100.0, 15: 5.0}, seed=-3, stop_token_ids=[4],
        min_new_tokens=3, logprobs=True, top_logprobs=16,
    )  # fmt: skip
    assert Sampler(16, [15], torch.device("cpu"), 2).validate(params) is None


def test_slot_bookkeeping() -> None:
    sampler = Sampler(16, [15], torch.device("cpu"), 2)
    assert sampler.state_bytes == 5 * 2 * 16
    sampler.add_seq(1, "a", SamplingParams(), [], [])
    with pytest.raises(ValueError, match="already held"):
        sampler.add_seq(1, "b", SamplingParams(), [], [])
    with pytest.raises(ValueError, match="outside"):
        sampler.add_seq(2, "b", SamplingParams(), [], [])
    with pytest.raises(KeyError):
        sampler.sample(torch.zeros(1, 16), [0])
    with pytest.raises(ValueError, match="shape"):
        sampler.sample(torch.zeros(1, 15), [1])
    sampler.remove_seq(1)
    with pytest.raises(KeyError):
        sampler.remove_seq(1)
    with pytest.raises(ValueError, match="eos"):
        Sampler(16, [16], torch.device("cpu"), 2)
    assert sampler.sample(torch.zeros(0, 16), []).token_ids.shape == (0,)
