"""Prompt logprobs through the real scheduler and model runner (tiny fp32 Llama on the CPU) against
transformers' log_softmax over the prompt: chunked prefill, a prefix-cache hit that is recomputed, a
preemption in the middle of the prefill; and their /generate and completions formats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from app import protocol as p
from app.http.native import NativeView
from app.http.openai_format import prompt_completion_logprobs
from app.scheduler.request import Status
from app.scheduler.scheduler import Scheduler, SchedulerConfig
from app.worker.model_runner import ModelRunner
from tests.support.model_factory import build_tiny_model
from tests.unit.test_model_runner import hf_model, make_settings

CHUNK = 5  # prefill chunks of 5 tokens over blocks of 4: chunk and block boundaries both fall mid-prompt
TOP = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), seed=11)


@pytest.fixture()
def engine(model_dir: Path) -> tuple[Scheduler, ModelRunner]:
    runner = ModelRunner(make_settings(model_dir, chunked_prefill_size=CHUNK, max_num_seqs=4, seed=0),
                         torch.device("cpu"))
    cfg = SchedulerConfig(runner.pool.num_blocks, runner.block_size, runner.max_model_len, 4, CHUNK, CHUNK,
                          True, ())
    return Scheduler(cfg), runner


def reference(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """transformers' logprobs [len(prompt) - 1, vocab]: row i is the distribution of prompt token i + 1."""
    with torch.no_grad():
        logits = hf_model(model_dir)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def ask(rid: str, prompt: list[int], start: int = -1, max_new: int = 2) -> p.TokenizedRequest:
    sampling = p.SamplingParams(max_new_tokens=max_new, temperature=0.0, logprobs=True, top_logprobs=TOP,
                                prompt_logprob_start=start)
    return p.TokenizedRequest(rid, prompt, sampling)


def run(sched: Scheduler, runner: ModelRunner, on_step: Any = None) -> dict[str, list[p.TokenDelta]]:
    deltas: dict[str, list[p.TokenDelta]] = {}
    for _ in range(200):
        plan = sched.schedule()
        if plan is None:
            break
        for delta in sched.process_result(runner.execute(plan)):
            deltas.setdefault(delta.rid, []).append(delta)
        if on_step is not None:
            on_step(plan)
    assert not sched.has_work()
    return deltas


def check(model_dir: Path, prompt: list[int], first: int, got: list[p.TokenLogprobs]) -> None:
    ref = reference(model_dir, prompt)
    assert [lp.token_id for lp in got] == prompt[first:]
    for i, lp in zip(range(first, len(prompt)), got, strict=True):
        row = ref[i - 1]
        assert lp.logprob == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        values, ids = row.topk(TOP)
        assert lp.top_ids == ids.tolist()
        assert lp.top_logprobs == pytest.approx(values.tolist(), abs=1e-4)


def prompt_of(n: int, salt: int) -> list[int]:
    return [(7 * i + salt) % 200 + 10 for i in range(n)]


def test_chunked_prefill_prompt_logprobs_match_transformers(model_dir: Path, engine: Any) -> None:
    sched, runner = engine
    prompt = prompt_of(19, 1)
    sched.add_request(ask("a", prompt, start=0))
    sched.add_request(ask("plain", prompt_of(9, 2)))  # does not ask: shares the steps, gets nothing
    deltas = run(sched, runner)
    first = deltas["a"][0]
    assert len(first.token_ids) == 1  # they come with the first output token, once
    check(model_dir, prompt, 1, first.prompt_logprobs)
    assert all(not d.prompt_logprobs for d in deltas["a"][1:])
    assert all(not d.prompt_logprobs for d in deltas["plain"])


def test_a_prefix_cache_hit_is_recomputed_from_the_first_wanted_position(model_dir: Path, engine: Any) -> None:
    sched, runner = engine
    shared = prompt_of(16, 3)
    sched.add_request(ask("warm", shared + [11, 12]))
    run(sched, runner)
    # Not asking: the 16 shared tokens (4 full blocks) come from the cache.
    sched.add_request(ask("hit", shared + [13, 14]))
    assert run(sched, runner)["hit"][0].cached_tokens == 16
    # Logprobs from token 10 on: position 9 must be computed, so only the first 2 blocks (8 tokens) are reused.
    prompt = shared + [15, 16, 17]
    sched.add_request(ask("b", prompt, start=10))
    first = run(sched, runner)["b"][0]
    assert first.cached_tokens == 8
    check(model_dir, prompt, 10, first.prompt_logprobs)


def test_a_preemption_mid_prefill_neither_loses_nor_duplicates(model_dir: Path, engine: Any) -> None:
    sched, runner = engine
    prompt = prompt_of(23, 4)
    sched.add_request(ask("c", prompt, start=2))
    req = sched.requests["c"]
    preempted = []

    def preempt_once(plan: p.StepPlan) -> None:
        if not preempted and req.status is Status.RUNNING and 0 < len(req.prompt_logprobs) < 15:
            preempted.append(len(req.prompt_logprobs))
            sched._preempt(req)

    deltas = run(sched, runner, preempt_once)
    assert preempted, "the request was never preempted in the middle of its prefill"
    assert sched.num_preemptions == 1
    check(model_dir, prompt, 2, deltas["c"][0].prompt_logprobs)


def _text_delta(prompt: list[int], lps: list[p.TokenLogprobs]) -> p.TextDelta:
    return p.TextDelta(rid="r", text="x", token_ids=[5], prompt_ids=prompt, prompt_logprobs=lps,
                       prompt_token_texts=[f"t{t}" for t in prompt],
                       prompt_top_token_texts=[[f"t{t}" for t in lp.top_ids] for lp in lps])


def test_generate_and_completions_formats() -> None:
    lps = [p.TokenLogprobs(8, -0.5, [8, 3], [-0.5, -1.0]), p.TokenLogprobs(9, -2.0, [3, 9], [-0.1, -2.0])]
    delta = _text_delta([7, 8, 9], lps)
    view = NativeView(["r"], False, 0.0, None, True, 2, True, 0)  # type: ignore[arg-type]
    out = view._logprobs(delta)
    assert out["input_token_logprobs"] == [[None, 7, "t7"], [-0.5, 8, "t8"], [-2.0, 9, "t9"]]
    assert out["input_top_logprobs"] == [None, [[-0.5, 8, "t8"], [-1.0, 3, "t3"]],
                                         [[-0.1, 3, "t3"], [-2.0, 9, "t9"]]]
    later = NativeView(["r"], False, 0.0, None, True, 0, False, 2)  # type: ignore[arg-type]
    assert later._logprobs(_text_delta([7, 8, 9], lps[1:]))["input_token_logprobs"] == [[-2.0, 9, None]]
    legacy = prompt_completion_logprobs(delta)
    assert legacy["tokens"] == ["t7", "t8", "t9"]
    assert legacy["token_logprobs"] == [None, -0.5, -2.0]
    assert legacy["top_logprobs"] == [None, {"t8": -0.5, "t3": -1.0}, {"t3": -0.1, "t9": -2.0}]
    assert legacy["text_offset"] == [0, 2, 4]
