"""Speculative decoding end to end in one process: the real Scheduler and a ModelRunner with NGRAM on a
tiny random Llama (CPU), against the same engine without speculation.

Greedy output must be token for token the same; this tiny random model falls into loops under greedy
decoding, so n-gram drafts are accepted and the multi-token paths (accepted runs, stops inside them,
block trimming) run. The KV pool must come back to zero after aborts and preemptions.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from app import protocol as p
from app.scheduler.scheduler import Scheduler, SchedulerConfig
from app.worker.model_runner import ModelRunner
from tests.support.model_factory import build_tiny_model
from tests.unit.test_model_runner import make_settings

CPU = torch.device("cpu")
K = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A smaller initializer range than the factory's: greedy output then mixes loops (drafts accepted)
    # with stretches the n-gram gets wrong (drafts rejected).
    return build_tiny_model("llama", tmp_path_factory.mktemp("spec") / "llama", initializer_range=0.1)


@pytest.fixture(scope="module")
def runners(model_dir: Path) -> dict[bool, ModelRunner]:
    common = {"max_num_seqs": 4, "chunked_prefill_size": 32, "max_model_len": 160, "seed": 0}
    spec = {"speculative_algorithm": "NGRAM", "speculative_num_steps": K}
    return {False: ModelRunner(make_settings(model_dir, **common), CPU),
            True: ModelRunner(make_settings(model_dir, **common, **spec), CPU)}


class Engine:
    """Scheduler and runner, one step at a time (the appliance's depth while speculating)."""

    def __init__(self, runner: ModelRunner, spec: bool, num_blocks: int | None = None) -> None:
        ready = runner.ready_message()
        config = SchedulerConfig(
            num_blocks=num_blocks or ready.num_blocks, block_size=ready.block_size,
            max_model_len=ready.max_model_len, max_num_seqs=4, chunked_prefill_size=32, max_prefill_tokens=4096,
            enable_prefix_caching=True, eos_token_ids=tuple(ready.eos_token_ids),
            num_speculative_tokens=K if spec else 0,
        )
        self.runner = runner
        self.scheduler = Scheduler(config)
        self.scheduler.take_counters()  # start counting
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, str | None] = {}
        self.max_tokens_per_step = 0

    def add(self, rid: str, prompt: list[int], **sampling: Any) -> None:
        params = p.SamplingParams(**{"temperature": 0.0, **sampling})
        self.scheduler.add_request(p.TokenizedRequest(rid=rid, prompt_ids=prompt, sampling=params))
        self.outputs[rid] = []

    def step(self) -> None:
        plan = self.scheduler.schedule()
        assert plan is not None
        with torch.inference_mode():
            result = self.runner.execute(plan)
        for delta in self.scheduler.process_result(result):
            self.outputs[delta.rid] += delta.token_ids
            self.max_tokens_per_step = max(self.max_tokens_per_step, len(delta.token_ids))
            if delta.finish_reason is not None:
                self.finish[delta.rid] = delta.finish_reason

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                break
            self.step()
        self.drain()

    def drain(self) -> None:
        """Let the worker release the freed slots (as the next plan would), then check the pool."""
        while self.scheduler.has_work():
            self.step()
        kv = self.scheduler.kv
        kv.check_invariants()
        assert kv.num_used_blocks == 0, "the KV pool did not return to zero"
        assert not any(self.runner.slots.active)


def prompts(vocab: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, vocab, (12,), generator=g).tolist()
    return {
        "loop": base * 3,  # repetitive: the drafts come from the prompt
        "short": torch.randint(3, vocab, (5,), generator=g).tolist(),
        "long": torch.randint(3, vocab, (45,), generator=g).tolist(),
    }


def test_greedy_with_ngram_equals_greedy_without(runners: dict[bool, ModelRunner]) -> None:
    outs = {}
    for spec in (False, True):
        engine = Engine(runners[spec], spec)
        for rid, prompt in prompts(runners[spec].vocab_size).items():
            engine.add(rid, prompt, max_new_tokens=40, ignore_eos=True)
        engine.run()
        outs[spec] = engine.outputs
        if spec:
            counters = engine.scheduler.take_counters()
            assert counters.spec_drafts > 0 and counters.spec_accepted_tokens > 0, counters
            assert engine.max_tokens_per_step > 1  # accepted runs came back as several tokens a step
    assert outs[True] == outs[False]
    assert all(len(tokens) == 40 for tokens in outs[True].values())


def test_stop_ids_and_max_tokens_match_the_plain_engine(runners: dict[bool, ModelRunner]) -> None:
    """Stop token ids and max_tokens end a speculating request where they end a plain one (a stop inside
    an accepted run, scripted: test_spec_scheduler.py)."""
    ps = prompts(runners[False].vocab_size)
    plain = Engine(runners[False], False)
    plain.add("ref", ps["short"], max_new_tokens=40, ignore_eos=True)
    plain.run()
    reference = plain.outputs["ref"]
    stop = reference[15]
    first = reference.index(stop)
    for spec in (False, True):
        engine = Engine(runners[spec], spec)
        engine.add("stop", ps["short"], max_new_tokens=40, ignore_eos=True, stop_token_ids=[stop])
        for n in (7, 13, 22):
            engine.add(f"len{n}", ps["short"], max_new_tokens=n, ignore_eos=True)
        engine.run()
        assert engine.outputs["stop"] == reference[: first + 1] and engine.finish["stop"] == p.FINISH_STOP
        for n in (7, 13, 22):
            assert engine.outputs[f"len{n}"] == reference[:n] and engine.finish[f"len{n}"] == p.FINISH_LENGTH


def aborts_and_preemption(plain: ModelRunner, speculating: ModelRunner) -> None:
    """A pool of 24 blocks of 4 tokens for four requests of 35 to 85 tokens: preemption is certain; two
    are aborted mid-decode. The outputs of the others stay the greedy ones (Engine.drain checks the pool
    and the slots)."""
    ps = prompts(plain.vocab_size)
    reference = Engine(plain, False)
    reference.add("a", ps["loop"], max_new_tokens=30, ignore_eos=True)
    reference.add("b", ps["short"], max_new_tokens=30, ignore_eos=True)
    reference.run()
    engine = Engine(speculating, True, num_blocks=24)
    engine.add("a", ps["loop"], max_new_tokens=30, ignore_eos=True)
    engine.add("b", ps["short"], max_new_tokens=30, ignore_eos=True)
    engine.add("c", ps["loop"][:20], max_new_tokens=60, ignore_eos=True)
    engine.add("d", ps["long"], max_new_tokens=40, ignore_eos=True)
    for _ in range(12):
        engine.step()
    engine.scheduler.abort("c")
    engine.scheduler.abort("d")
    engine.run()
    assert engine.scheduler.num_preemptions > 0
    assert engine.outputs["a"] == reference.outputs["a"] and engine.outputs["b"] == reference.outputs["b"]


def test_pool_returns_to_zero_after_aborts_and_preemption(runners: dict[bool, ModelRunner]) -> None:
    aborts_and_preemption(runners[False], runners[True])


def test_rows_that_need_per_token_state_do_not_draft(runners: dict[bool, ModelRunner]) -> None:
    """Penalties, logprobs and seeds decode one token a step (k = 0) beside drafting rows."""
    engine = Engine(runners[True], True)
    loop = prompts(runners[True].vocab_size)["loop"]
    engine.add("pen", loop, max_new_tokens=20, ignore_eos=True, repetition_penalty=1.3)
    engine.add("lp", loop, max_new_tokens=20, ignore_eos=True, logprobs=True)
    engine.add("seed", loop, max_new_tokens=20, ignore_eos=True, temperature=1.0, seed=5)
    engine.add("free", loop, max_new_tokens=20, ignore_eos=True)
    drafting: set[str] = set()
    for _ in range(200):
        if not engine.scheduler.has_work():
            break
        plan = engine.scheduler.schedule()
        assert plan is not None
        by_slot = {req.slot: rid for rid, req in engine.scheduler.requests.items()}
        drafting |= {by_slot[c.slot] for c in plan.chunks if c.num_draft}
        with torch.inference_mode():
            for delta in engine.scheduler.process_result(engine.runner.execute(plan)):
                engine.outputs[delta.rid] += delta.token_ids
    engine.drain()
    assert drafting == {"free"}
    assert all(len(out) == 20 for out in engine.outputs.values())


def test_sampled_rows_speculate_and_finish(runners: dict[bool, ModelRunner]) -> None:
    """temperature > 0 without a seed drafts too (its distribution: test_spec_verify.py)."""
    engine = Engine(runners[True], True)
    loop = prompts(runners[True].vocab_size)["loop"]
    engine.add("hot", loop, max_new_tokens=30, ignore_eos=True, temperature=0.3, top_k=20, top_p=0.9)
    engine.run()
    assert len(engine.outputs["hot"]) == 30
    assert engine.scheduler.take_counters().spec_drafts > 0


def test_replace_keeps_field_order() -> None:
    """The new wire fields come last, with defaults (the field order is the contract)."""
    assert [f.name for f in dataclasses.fields(p.SeqChunk)][-1] == "num_draft"
    assert [f.name for f in dataclasses.fields(p.StepResult)][-2:] == ["accepted_ids", "draft_counts"]
