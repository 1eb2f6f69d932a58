"""The scheduler's side of speculative decoding, against a scripted worker: draft room, accepted runs,
stops inside them, trimming of the rejected positions' blocks, and the pool back to zero."""

from __future__ import annotations

import pytest

from app import protocol as p
from app.scheduler.scheduler import Scheduler, SchedulerConfig

BS, K = 4, 3


def make_scheduler(num_blocks: int = 64, k: int = K) -> Scheduler:
    config = SchedulerConfig(num_blocks=num_blocks, block_size=BS, max_model_len=64, max_num_seqs=4,
                             chunked_prefill_size=64, max_prefill_tokens=64, enable_prefix_caching=True,
                             eos_token_ids=(2,), num_speculative_tokens=k)
    scheduler = Scheduler(config)
    scheduler.take_counters()
    return scheduler


class ScriptedWorker:
    """Each request's "model" emits script[rid] in order; a drafting decode accepts `accept` of its drafts
    (the script's next tokens) and then samples the one after them."""

    def __init__(self, scheduler: Scheduler, script: dict[str, list[int]], accept: int) -> None:
        self.scheduler, self.script, self.accept = scheduler, script, accept
        self.emitted = {rid: 0 for rid in script}
        self.plans: list[p.StepPlan] = []

    def step(self) -> list[p.TokenDelta]:
        plan = self.scheduler.schedule()
        assert plan is not None
        self.plans.append(plan)
        by_slot = {req.slot: req.rid for req in self.scheduler.running}
        result = p.StepResult(step=plan.step)
        for chunk in plan.chunks:
            if not chunk.sample:
                continue
            rid = by_slot[chunk.slot]
            kept = min(self.accept, chunk.num_draft)
            at = self.emitted[rid]
            run = self.script[rid][at : at + kept + 1]
            self.emitted[rid] += len(run)
            result.slots.append(chunk.slot)
            result.token_ids.append(run[-1])
            result.accepted_ids.append(run[:-1])
            result.draft_counts.append(chunk.num_draft)
        return self.scheduler.process_result(result)


def add(scheduler: Scheduler, rid: str, n_prompt: int = 6, **sampling: object) -> None:
    params = p.SamplingParams(temperature=0.0, **sampling)  # type: ignore[arg-type]
    scheduler.add_request(p.TokenizedRequest(rid=rid, prompt_ids=list(range(10, 10 + n_prompt)), sampling=params))


def run(worker: ScriptedWorker) -> tuple[dict[str, list[int]], dict[str, str]]:
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    while worker.scheduler.has_work():
        for delta in worker.step():
            outputs.setdefault(delta.rid, []).extend(delta.token_ids)
            if delta.finish_reason:
                finish[delta.rid] = delta.finish_reason
        for req in worker.scheduler.running:  # rejected positions' blocks are freed after each step
            assert len(req.block_ids) <= worker.scheduler.kv.blocks_needed(req.num_tokens + K)
    worker.scheduler.kv.check_invariants()
    assert worker.scheduler.kv.num_used_blocks == 0
    return outputs, finish


SCRIPT = [100 + i for i in range(40)]


@pytest.mark.parametrize("accept", [0, 1, 3])
def test_accepted_runs_come_out_in_order(accept: int) -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", max_new_tokens=17)
    worker = ScriptedWorker(scheduler, {"a": SCRIPT}, accept)
    outputs, finish = run(worker)
    assert outputs["a"] == SCRIPT[:17] and finish["a"] == p.FINISH_LENGTH
    decodes = [c for plan in worker.plans for c in plan.chunks if not c.token_ids]
    assert max(c.num_draft for c in decodes) == K
    # Never planned past max_tokens: each step's drafts fit what is left.
    decode_steps = len(decodes)
    assert decode_steps == 16 // (accept + 1)
    counters = scheduler.take_counters()
    assert counters.spec_accepted_tokens == 16 - decode_steps
    assert counters.spec_drafts == sum(1 for c in decodes if c.num_draft)
    assert counters.spec_draft_tokens == sum(c.num_draft for c in decodes)


def test_stop_id_and_eos_inside_an_accepted_run_drop_the_rest() -> None:
    scheduler = make_scheduler()
    add(scheduler, "stop", stop_token_ids=[105])
    add(scheduler, "eos")
    eos_script = [200, 201, 202, 203, 204, 2, 205, 206, 207, 208]
    worker = ScriptedWorker(scheduler, {"stop": SCRIPT, "eos": eos_script}, accept=3)
    outputs, finish = run(worker)
    assert outputs["stop"] == SCRIPT[:6] and finish["stop"] == p.FINISH_STOP
    assert outputs["eos"] == eos_script[:6] and finish["eos"] == p.FINISH_STOP


def test_drafts_take_only_free_blocks_and_the_budget() -> None:
    """Lookahead never preempts: with no block free for drafts, the decode goes on with fewer."""
    scheduler = make_scheduler(num_blocks=3, k=K)  # 12 tokens: prompt 6 + a few
    add(scheduler, "a", max_new_tokens=6)
    worker = ScriptedWorker(scheduler, {"a": SCRIPT}, accept=3)
    outputs, _ = run(worker)
    assert outputs["a"] == SCRIPT[:6]
    assert scheduler.num_preemptions == 0


def test_rows_with_per_token_state_get_no_drafts() -> None:
    scheduler = make_scheduler()
    add(scheduler, "pen", frequency_penalty=0.5, max_new_tokens=5)
    add(scheduler, "min", min_new_tokens=3, max_new_tokens=8)
    worker = ScriptedWorker(scheduler, {"pen": SCRIPT, "min": SCRIPT}, accept=3)
    drafted: dict[str, list[int]] = {"pen": [], "min": []}
    while scheduler.has_work():
        slots = {req.slot: req for req in scheduler.running}
        worker.step()
        for chunk in worker.plans[-1].chunks:
            req = slots.get(chunk.slot)
            if req is not None and not chunk.token_ids:
                drafted[req.rid].append(chunk.num_draft)
    assert set(drafted["pen"]) == {0}
    assert drafted["min"][:2] == [0, 0] and max(drafted["min"]) > 0  # drafts once min_tokens is met


def test_prometheus_counters_count_drafts_and_acceptance() -> None:
    from prometheus_client import CollectorRegistry

    from app.metrics.engine import EngineMetrics

    registry = CollectorRegistry()
    scheduler = make_scheduler()
    metrics = EngineMetrics(scheduler, "m", registry=registry)
    add(scheduler, "a", max_new_tokens=9)
    worker = ScriptedWorker(scheduler, {"a": SCRIPT}, accept=1)
    while scheduler.has_work():
        worker.step()
        metrics.update()
    labels = {"model_name": "m", "dp_rank": "0"}

    def value(name: str, **extra: str) -> float | None:
        return registry.get_sample_value(f"tokenspeed:{name}_total", {**labels, **extra})

    # 8 tokens after the prefill's: decodes of 3 drafts giving 2 tokens each (the last one capped to 1 draft).
    assert value("spec_decode_num_drafts") == 4
    assert value("spec_decode_num_draft_tokens") == 3 + 3 + 3 + 1
    assert value("spec_decode_num_accepted_tokens") == 4
    assert value("spec_decode_num_accepted_tokens_per_pos", position="0") == 4
    assert value("spec_decode_num_accepted_tokens_per_pos", position="1") is None
    plain = EngineMetrics(make_scheduler(k=0), "m", registry=CollectorRegistry())
    assert plain._spec is None  # no speculative series without speculation
