"""The model drafts end to end in one process: the real Scheduler and a ModelRunner speculating with a
draft model (the tiny model drafting for itself) or a random EAGLE-3 head, against the same engine
without speculation (tests/unit/test_speculative_engine.py's Engine). Greedy output must be token for
token the same, the KV pool must come back to zero (aborts and preemption too), and a model drafting
for itself must be accepted (almost) always."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.worker.model_runner import ModelRunner
from tests.support.eagle3_factory import build_eagle3_head
from tests.support.model_factory import build_tiny_model
from tests.unit.test_model_runner import make_settings
from tests.unit.test_speculative_engine import CPU, Engine, K, aborts_and_preemption, prompts

COMMON = {"max_num_seqs": 4, "chunked_prefill_size": 32, "max_model_len": 160, "seed": 0}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spec_model")
    target = build_tiny_model("llama", root / "llama", seed=4, num_hidden_layers=4)
    return target, build_eagle3_head(target, root / "head", draft_vocab=80, seed=1)


@pytest.fixture(scope="module")
def runners(dirs: tuple[Path, Path]) -> dict[str, ModelRunner]:
    target, head = dirs
    spec = {"speculative_num_steps": K}
    return {
        "plain": ModelRunner(make_settings(target, **COMMON), CPU),
        "draft": ModelRunner(make_settings(target, **COMMON, **spec, speculative_algorithm="STANDALONE",
                                           speculative_draft_model_path=str(target)), CPU),
        "eagle3": ModelRunner(make_settings(target, **COMMON, **spec, speculative_algorithm="EAGLE3",
                                            speculative_draft_model_path=str(head)), CPU),
    }


def outputs(runner: ModelRunner, spec: bool, requests: dict[str, list[int]], **sampling: object
            ) -> tuple[dict[str, list[int]], Engine]:
    engine = Engine(runner, spec)
    for rid, prompt in requests.items():
        engine.add(rid, prompt, **{"max_new_tokens": 30, "ignore_eos": True, **sampling})
    engine.run()
    return engine.outputs, engine


def test_the_draft_pool_counts_both_models(runners: dict[str, ModelRunner]) -> None:
    """The draft's cache covers the pool's block ids (scratch included) with its own bytes per token, which
    the runner adds to the target's when it sizes the pool (on the GPU: by bytes; here capped in tokens)."""
    plain, draft = runners["plain"], runners["draft"]
    assert draft.pool.num_blocks == plain.pool.num_blocks  # --max-total-tokens caps both in tokens
    assert draft.drafter is not None and draft.drafter.cache is not None
    assert draft.drafter.cache.num_blocks == draft.kv_cache.num_blocks  # the same block ids, scratch included
    assert draft.drafter.kv_bytes_per_token(draft.dtype) == draft.model.kv_cache_spec(draft.dtype).bytes_per_token


def test_a_model_drafting_for_itself_is_greedy_and_accepted(runners: dict[str, ModelRunner]) -> None:
    requests = prompts(runners["plain"].vocab_size)
    want, _ = outputs(runners["plain"], False, requests)
    got, engine = outputs(runners["draft"], True, requests)
    assert got == want
    counters = engine.scheduler.take_counters()
    assert counters.spec_draft_tokens > 0
    rate = counters.spec_accepted_tokens / counters.spec_draft_tokens
    assert rate > 0.9, f"a model drafting for itself should be accepted (almost) always, got {rate:.2f}"
    assert engine.max_tokens_per_step == K + 1  # whole runs of drafts came back in one step


def test_eagle3_head_is_greedy(runners: dict[str, ModelRunner]) -> None:
    """A random head is rarely right: exactness is what is tested (and that it drafts at all)."""
    requests = prompts(runners["plain"].vocab_size)
    want, _ = outputs(runners["plain"], False, requests)
    got, engine = outputs(runners["eagle3"], True, requests)
    assert got == want
    assert engine.scheduler.take_counters().spec_draft_tokens > 0
    assert runners["eagle3"].spec is not None and runners["eagle3"].spec.proposer.capture_layers == (2, 2, 1)


@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_pool_returns_to_zero_after_aborts_and_preemption(runners: dict[str, ModelRunner], method: str) -> None:
    aborts_and_preemption(runners["plain"], runners[method])


@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_sampled_rows_with_model_drafts(runners: dict[str, ModelRunner], method: str) -> None:
    """temperature > 0 drafts too (greedy drafts: the verifier keeps the target's distribution, tested in
    test_spec_verify.py) beside rows that decode one token a step (penalties); all finish."""
    ps = prompts(runners["plain"].vocab_size)
    engine = Engine(runners[method], True)
    engine.add("hot", ps["loop"], max_new_tokens=25, ignore_eos=True, temperature=0.8, top_k=20)
    engine.add("pen", ps["short"], max_new_tokens=25, ignore_eos=True, repetition_penalty=1.2)
    engine.run()
    assert [len(engine.outputs[rid]) for rid in ("hot", "pen")] == [25, 25]
    assert engine.scheduler.take_counters().spec_drafts > 0
