"""One request's problem fails that request alone (issue 28): the worker refuses a sequence it cannot run
and computes the step's other rows exactly as without it; the scheduler fails the refused request with a
400, frees its KV and carries on; the tokenizer refuses at admission what the engine reported it cannot
serve. Each audited path has a case here (docs/operations.md lists them)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from app import protocol as p
from app.protocol import NewSeq, SamplingParams, SeqChunk, StepPlan
from app.tokenizer.core import admission_error
from app.worker.model_runner import ModelRunner
from tests.support.model_factory import build_tiny_model
from tests.unit.test_model_runner import CPU, make_settings, prompts_for
from tests.unit.test_scheduler import FakeWorker, make, reference, request, run

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, top_k=20, seed=7)  # a sampled neighbour: its draws must not move


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("isolation"), seed=5)


@pytest.fixture(scope="module")
def runners(llama_dir: Path) -> dict[str | None, ModelRunner]:
    return {backend: ModelRunner(make_settings(llama_dir, sampling_backend=backend), CPU)
            for backend in (None, "greedy")}


def _seq(slot: int, rid: str, sampling: SamplingParams, prompt: list[int], blocks: list[int], **kw: Any) -> NewSeq:
    return NewSeq(slot=slot, rid=rid, sampling=sampling, num_prompt_tokens=len(prompt), block_ids=blocks,
                  prompt_ids=prompt, **kw)


def _drive(runner: ModelRunner, neighbours: list[NewSeq], bad: NewSeq | None, bad_chunk: list[int] | None,
           steps: int = 6) -> tuple[dict[int, list[int]], list[p.StepResult]]:
    """Prefill the neighbours (and the bad sequence) in one step, then decode; the bad slot's decode
    chunk is still in the next plan, as a pipelined scheduler planned it before hearing of the refusal,
    and its slot is freed in the one after. Returns each neighbour's tokens and the results."""
    seqs = [*neighbours, *([bad] if bad else [])]
    chunks = [SeqChunk(s.slot, list(s.prompt_ids)) for s in neighbours]
    if bad is not None:
        chunks.insert(1, SeqChunk(bad.slot, bad_chunk or list(bad.prompt_ids)))
    results = [runner.execute(StepPlan(step=0, new_seqs=seqs, chunks=chunks))]
    for step in range(1, steps):
        decode = [SeqChunk(s.slot) for s in seqs if step == 1 or s is not bad]
        free = [bad.slot] if bad is not None and step == 2 else []
        results.append(runner.execute(StepPlan(step=step, chunks=decode, free_slots=free)))
    runner.execute(StepPlan(step=steps, free_slots=[s.slot for s in neighbours]))
    tokens: dict[int, list[int]] = {s.slot: [] for s in neighbours}
    for result in results:
        for slot, token in zip(result.slots, result.token_ids, strict=True):
            tokens[slot].append(token)
    return tokens, results


REFUSALS = {  # audited path: (sampling backend, the bad sequence's parameters for vocab V, its error)
    "sampling": (None, lambda v: dataclasses.replace(GREEDY, top_k=0), "top_k must be"),
    "greedy backend": ("greedy", lambda v: SamplingParams(temperature=0.9), "supports only greedy decoding"),
    "logit_bias": (None, lambda v: dataclasses.replace(GREEDY, logit_bias={v: 5.0}), "logit_bias key"),
    "stop ids": (None, lambda v: dataclasses.replace(GREEDY, stop_token_ids=[v + 3]), "stop_token_ids entry"),
    "penalties": (None, lambda v: dataclasses.replace(GREEDY, repetition_penalty=0.0), "repetition_penalty"),
    "min_tokens": (None, lambda v: dataclasses.replace(GREEDY, min_new_tokens=-1), "min_new_tokens"),
    "logprobs": (None, lambda v: dataclasses.replace(GREEDY, logprobs=True, top_logprobs=v + 1), "top_logprobs"),
    "seeds": (None, lambda v: dataclasses.replace(SEEDED, seed="7"), "seed must be an integer"),
    "prompt ids": (None, lambda v: GREEDY, "outside the vocabulary"),
    "prefix-cache hit": (None, lambda v: dataclasses.replace(GREEDY, top_p=0.0), "top_p must be"),
    "preemption": (None, lambda v: dataclasses.replace(GREEDY, presence_penalty=float("nan")), "presence_penalty"),
}


@pytest.mark.parametrize("path", list(REFUSALS))
def test_a_refused_sequence_leaves_its_batch_mates_tokens_unchanged(runners, path: str) -> None:
    backend, bad_params, message = REFUSALS[path]
    runner = runners[backend]
    vocab = runner.vocab_size
    prompts = prompts_for(runner.vocab_size, [7, 5, 6], seed=3)
    other = GREEDY if backend == "greedy" else SEEDED
    neighbours = [_seq(0, "a", GREEDY, prompts[0], [0, 1, 2]), _seq(2, "b", other, prompts[1], [3, 4, 5])]
    alone, _ = _drive(runner, neighbours, None, None)
    kw: dict[str, Any] = {}
    bad_chunk, prompt, blocks = None, prompts[2], [6, 7, 8]
    if path == "prompt ids":
        bad_chunk = [*prompts[2][:-1], vocab + 10]
    if path == "prefix-cache hit":  # its first block is a's, cached; the rest is fed
        prompt, blocks = prompts[0][:4] + prompts[2], [0, 7, 8]
        kw, bad_chunk = {"num_cached_tokens": 4}, prompts[2]
    if path == "preemption":  # it re-enters with the tokens it generated before it was preempted
        kw = {"output_ids": [5, 6]}
    bad = _seq(1, "bad", bad_params(vocab), prompt, blocks, **kw)
    together, results = _drive(runner, neighbours, bad, bad_chunk)
    assert together == alone  # exactly the tokens they had without it
    assert (results[0].failed_slots, results[0].error) == ([1], None)
    assert message in results[0].failed_errors[0]
    assert all(not r.failed_slots and r.error is None and 1 not in r.slots for r in results[1:])
    assert not any(runner.slots.active) and not runner._refused  # freed; the slot serves again
    again, _ = _drive(runner, [_seq(1, "next", GREEDY, prompts[0], [9, 10, 11])], None, None)
    assert again[1] == alone[0]


def test_nan_logits_fail_that_row_alone(runners, monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN/inf logits (bad weights for one input, a broken processor) flag that row; the others sample."""
    runner = runners[None]
    prompts = prompts_for(runner.vocab_size, [7, 5], seed=4)
    seqs = [_seq(0, "a", GREEDY, prompts[0], [0, 1]), _seq(1, "b", SEEDED, prompts[1], [2, 3])]
    alone, _ = _drive(runner, seqs[:1], None, None, steps=2)
    real = runner.model.compute_logits

    def poisoned(hidden: torch.Tensor) -> torch.Tensor:
        logits = real(hidden)
        logits[-1, 3] = float("nan")  # the last sampled row: b's
        return logits

    monkeypatch.setattr(runner.model, "compute_logits", poisoned)
    result = runner.execute(StepPlan(step=0, new_seqs=seqs, chunks=[SeqChunk(s.slot, list(s.prompt_ids)) for s in seqs]))
    monkeypatch.undo()
    assert result.bad_slots == [1] and result.error is None and result.token_ids[0] == alone[0][0]
    runner.execute(StepPlan(step=1, free_slots=[0, 1]))


class RefusingWorker(FakeWorker):
    """The scheduler's test worker with the runner's contract for refused sequences: one whose rid
    starts with "bad-" is refused (StepResult.failed_slots) and its chunks skipped until its slot is freed."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.refused: set[int] = set()

    def execute(self, plan: p.StepPlan) -> p.StepResult:
        refused = [s.slot for s in plan.new_seqs if s.rid.startswith("bad-")]
        self.refused.update(refused)
        kept = dataclasses.replace(plan, new_seqs=[s for s in plan.new_seqs if s.slot not in self.refused],
                                   chunks=[c for c in plan.chunks if c.slot not in self.refused],
                                   free_slots=[s for s in plan.free_slots if s not in self.refused])
        self.refused -= set(plan.free_slots)
        result = super().execute(kept)
        result.failed_slots, result.failed_errors = refused, ["top_k must be -1 (disabled)"] * len(refused)
        return result


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("pool", [64, 9])  # 9 blocks: the good requests preempt each other
def test_scheduler_fails_a_refused_request_alone_and_frees_its_blocks(overlap: bool, pool: int) -> None:
    sched, worker = make(num_blocks=pool)
    worker = RefusingWorker(pool, 4)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    good = {"g1": shared + [13, 14], "g2": [21, 22, 23], "g3": shared + [40]}  # g3: a prefix-cache hit
    arrivals = {0: [request("g1", good["g1"], 12), request("bad-1", shared + [30], 12)],
                3: [request("g2", good["g2"], 10), request("bad-2", [31, 32], 5), request("g3", good["g3"], 8)]}
    outputs, finals = run(sched, worker, arrivals, overlap=overlap)  # asserts no block leaked
    for rid, prompt in good.items():
        assert outputs[rid] == reference(prompt, len(outputs[rid])) and finals[rid].error is None
    for rid in ("bad-1", "bad-2"):
        assert (finals[rid].error_code, finals[rid].error) == (400, "top_k must be -1 (disabled)")
        assert outputs[rid] == []


ENGINE = p.EngineInfo(max_model_len=64, vocab_size=256, eos_token_ids=[2], max_top_logprobs=20)


@pytest.mark.parametrize(("backend", "sampling", "field"), [
    ("greedy", SamplingParams(temperature=0.9), "temperature=0.9"),
    ("greedy", dataclasses.replace(GREEDY, repetition_penalty=1.2), "repetition_penalty"),
    (None, dataclasses.replace(GREEDY, logit_bias={256: 1.0}), "logit_bias key 256"),
    (None, dataclasses.replace(GREEDY, stop_token_ids=[256]), "stop_token_ids entry 256"),
    (None, dataclasses.replace(GREEDY, logprobs=True, top_logprobs=21), "top_logprobs 21 exceeds"),
])
def test_admission_refuses_what_the_engine_reported_it_cannot_serve(backend, sampling, field) -> None:
    engine = dataclasses.replace(ENGINE, sampling_backend=backend)
    assert field in (admission_error(sampling, engine) or "")
    assert admission_error(GREEDY, engine) is None
    assert admission_error(dataclasses.replace(GREEDY, logprobs=True, top_logprobs=20), engine) is None


def test_the_tokenizer_answers_a_refused_request_itself() -> None:
    """Nothing reaches the scheduler: the client gets the 400 at once, and the next request is served."""
    from app.tokenizer.core import HTTP, SCHEDULER, TokenizerCore

    core = TokenizerCore(None)
    core.handle(p.EngineReady(engine=dataclasses.replace(ENGINE, sampling_backend="greedy")))
    [out] = core.handle(p.GenerateRequest(rid="hot", sampling=SamplingParams(temperature=0.9), input_ids=[5, 6]))
    [delta] = out.msg.deltas
    assert out.dest == HTTP and delta.error_code == 400 and "temperature=0.9" in delta.error
    [ok] = core.handle(p.GenerateRequest(rid="cold", sampling=GREEDY, input_ids=[5, 6]))
    assert ok.dest == SCHEDULER and core.num_live_requests == 1
