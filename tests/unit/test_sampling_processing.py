"""Logit processing (bias, min_new_tokens, penalties) and logprobs against loop-based references."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

from app.protocol import SamplingParams
from app.worker.sampling import Sampler

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
VOCAB = 24
EOS = [22, 23]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def reference_process(
    logits: list[float], p: SamplingParams, prompt: list[int], output: list[int], eos: list[int]
) -> list[float]:
    """The documented order, one token at a time: bias, min_new_tokens, repetition, presence/frequency."""
    x = list(logits)
    for token, bias in p.logit_bias.items():
        x[token] += bias
    if len(output) < p.min_new_tokens:
        for token in set(eos) | set(p.stop_token_ids):
            x[token] = -math.inf
    for token in set(prompt) | set(output):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token, count in Counter(output).items():
        x[token] -= p.presence_penalty + p.frequency_penalty * count
    return x


SEQS = {  # slot: (params, prompt, output generated before a preemption)
    0: (SamplingParams(temperature=0.0), [1, 2, 3], []),
    2: (SamplingParams(temperature=0.9, repetition_penalty=1.5), [4, 5, 5, 6], [7]),
    3: (SamplingParams(temperature=0.0, presence_penalty=0.8, frequency_penalty=0.3), [8, 9], [9, 10, 10]),
    5: (SamplingParams(temperature=1.2, logit_bias={3: 2.5, 11: -1.0, 4: 0.7}, seed=5), [3, 4], []),
    6: (
        SamplingParams(
            temperature=0.7,
            top_k=6,
            repetition_penalty=0.8,
            presence_penalty=-0.5,
            frequency_penalty=0.6,
            logit_bias={1: 1.0, 2: -0.6},
            min_new_tokens=4,
            stop_token_ids=[12],
            seed=9,
        ),
        [1, 2, 2, 13],
        [2, 14],
    ),
    7: (SamplingParams(temperature=1.0, min_new_tokens=3, top_p=0.9), [], []),
}


def test_processing_matches_the_reference_over_steps(device: torch.device) -> None:
    sampler = Sampler(VOCAB, EOS, device, 8, seed=0)
    outputs = {}
    for slot, (params, prompt, output) in SEQS.items():
        sampler.add_seq(slot, f"r{slot}", params, prompt, output)
        outputs[slot] = list(output)
    gen = torch.Generator().manual_seed(0)
    for step in range(8):
        order = [list(SEQS)[i] for i in torch.randperm(len(SEQS), generator=gen).tolist()]
        logits = torch.randn(len(order), VOCAB, generator=gen) * 2
        processed = sampler.process_logits(logits.to(device), order).cpu()
        for row, slot in enumerate(order):
            params, prompt, _ = SEQS[slot]
            expected = reference_process(logits[row].tolist(), params, prompt, outputs[slot], EOS)
            torch.testing.assert_close(processed[row], torch.tensor(expected), msg=f"step {step} slot {slot}")
        tokens = sampler.sample(logits.to(device), order).token_ids.tolist()
        for slot, token in zip(order, tokens, strict=True):
            outputs[slot].append(token)


def test_logits_of_the_caller_are_untouched(device: torch.device) -> None:
    sampler = Sampler(VOCAB, EOS, device, 8)
    sampler.add_seq(0, "a", SEQS[6][0], SEQS[6][1], SEQS[6][2])
    logits = torch.randn(1, VOCAB, device=device)
    before = logits.clone()
    sampler.sample(logits, [0])
    assert torch.equal(logits, before)


def test_repetition_penalty_counts_prompt_tokens_presence_does_not(device: torch.device) -> None:
    sampler = Sampler(5, [4], device, 4)
    sampler.add_seq(0, "rep", SamplingParams(repetition_penalty=2.0), [1, 2], [])
    sampler.add_seq(1, "presence", SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [1, 2], [1])
    logits = torch.tensor([[0.0, 2.0, -1.0, 0.5, 0.0]] * 2, device=device)
    processed = sampler.process_logits(logits, [0, 1]).tolist()
    assert processed[0] == [0.0, 1.0, -2.0, 0.5, 0.0]  # prompt tokens 1 and 2 penalised
    assert processed[1] == [0.0, 1.25, -1.0, 0.5, 0.0]  # only output token 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_new_tokens_blocks_eos_and_stop_ids(device: torch.device, temperature: float) -> None:
    params = SamplingParams(temperature=temperature, min_new_tokens=4, stop_token_ids=[3], seed=1)
    sampler = Sampler(12, [10, 11], device, 4)
    sampler.add_seq(0, "fresh", params, [0], [])
    sampler.add_seq(1, "preempted", params, [0], [5, 6, 7])  # three tokens already count
    logits = torch.zeros(2, 12, device=device)
    logits[:, 10], logits[:, 11], logits[:, 3] = 30.0, 29.0, 28.0
    steps = [sampler.sample(logits, [0, 1]).token_ids.tolist() for _ in range(5)]
    fresh, preempted = [s[0] for s in steps], [s[1] for s in steps]
    assert not {10, 11, 3} & set(fresh[:4]) and fresh[4] == 10
    assert preempted[0] not in {10, 11, 3} and preempted[1] == 10


def test_logprobs_are_log_softmax_of_processed_logits(device: torch.device) -> None:
    sampler = Sampler(VOCAB, EOS, device, 8, seed=3)
    top = dataclasses.replace(SEQS[6][0], logprobs=True, top_logprobs=5)
    plain = SamplingParams(temperature=1.5, top_p=0.5, logit_bias={0: 1.0}, logprobs=True)
    sampler.add_seq(1, "top", top, SEQS[6][1], SEQS[6][2])
    sampler.add_seq(4, "plain", plain, [], [])
    sampler.add_seq(6, "none", SamplingParams(temperature=1.0), [], [])
    history = {1: list(SEQS[6][2]), 4: []}
    gen = torch.Generator().manual_seed(4)
    for _ in range(5):
        logits = torch.randn(3, VOCAB, generator=gen) * 3
        out = sampler.sample(logits.to(device), [6, 1, 4])
        assert out.logprobs[0] is None
        for row, slot, params, prompt in ((1, 1, top, SEQS[6][1]), (2, 4, plain, [])):
            expected = reference_process(logits[row].tolist(), params, prompt, history[slot], EOS)
            logprobs = torch.log_softmax(torch.tensor(expected, dtype=torch.float64), dim=0)
            result = out.logprobs[row]
            assert result.token_id == out.token_ids[row].item()
            assert result.logprob == pytest.approx(logprobs[result.token_id].item(), abs=1e-5)
            k = params.top_logprobs
            assert len(result.top_ids) == len(result.top_logprobs) == k
            assert result.top_logprobs == sorted(result.top_logprobs, reverse=True)
            assert result.top_ids == logprobs.topk(k).indices.tolist()
            assert result.top_logprobs == pytest.approx(logprobs.topk(k).values.tolist(), abs=1e-5)
            history[slot].append(result.token_id)
